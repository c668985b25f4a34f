"""The simulator runs the pure policies, never a service adapter (issue 26 item 1): a
simulation loads no service's NATS shell (``services.<x>.service``, its ``__main__``)
nor the stack launcher (``perigee.stack``, ``perigee.up``); the defaults they share
come from services.common.defaults. What the sources of perigee/sim import, however
deep, is checked by tests/unit/test_import_layers.py; this runs one simulation and
looks at what it loaded."""

import subprocess
import sys


def test_a_simulation_loads_no_adapter():
    code = (
        "import sys\n"
        "from perigee.sim.simulator import simulate_slice\n"
        "from perigee.trace import TraceRequest\n"
        "simulate_slice([TraceRequest(0.0, 600, 4, (1,)), TraceRequest(0.1, 700, 4, (1,))],"
        " block_size=512)\n"
        "bad = [m for m in sys.modules if m in ('perigee.stack', 'perigee.up')"
        " or (m.startswith('services.') and m.split('.')[-1] in ('service', '__main__'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
