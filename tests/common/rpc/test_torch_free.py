"""The shared gRPC server module and its exceptions load without torch (a service that needs
no tensors, such as a rule-based reward server, starts without it)."""

import subprocess
import sys

CODE = """
import sys
import services.common.rpc.errors
import services.common.rpc.server
from services.common.rpc.server import BadRequest, Unavailable
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, f"torch was imported: {loaded[:5]}"
"""


def test_rpc_server_imports_without_torch():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_bad_request_is_one_class_everywhere():
    from services.common.rpc import codec, errors, server

    assert codec.BadRequest is errors.BadRequest is server.BadRequest
    assert server.Unavailable is errors.Unavailable
