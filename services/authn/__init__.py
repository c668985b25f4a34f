"""Per-pod bus logins on Kubernetes: a NATS auth callout that believes a pod's projected
ServiceAccount token and grants that pod's own subjects only (SECURITY.md "Bus")."""
