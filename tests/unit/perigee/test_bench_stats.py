"""perigee.bench.stats: the machine a result names."""

import os
import platform

from perigee.bench.stats import machine, machine_line


def test_the_machine_names_its_cpu_model_cores_kernel_and_python(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Example CPU @ 2.10GHz\n")
    m = machine(str(info))
    assert m == {
        "cpu": "Example CPU @ 2.10GHz",
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    assert machine_line(m).startswith(f"{os.cpu_count()} x Example CPU @ 2.10GHz, kernel ")


def test_without_a_cpuinfo_the_platform_names_the_cpu(tmp_path):
    m = machine(str(tmp_path / "absent"))
    assert m["cpu"] == (platform.processor() or platform.machine())
    assert m["cores"] == os.cpu_count()
