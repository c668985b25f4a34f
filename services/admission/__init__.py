"""Admission: Early Rejection at the door (paper §4.3). Pure piece: policy.AdmissionPolicy."""
