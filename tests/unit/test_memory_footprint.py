"""The operator's fixed memory: what it imports to run. The kubernetes client's CoreV1Api module alone
is about 20 MB of resident memory (thousands of annotated methods); the operator makes three core/v1
calls (list Events, post an Event, delete a JobSet's pods) and makes them through the generic client."""

import subprocess
import sys

CODE = """
import sys
from kubernetes import client
from tpujob_operator import kube
from tpujob_operator.runtime import Runtime

client.Configuration.set_default(client.Configuration(host="http://127.0.0.1:1"))  # never called here
kube.Cluster()
Runtime()
loaded = sorted(m for m in sys.modules if m == "kubernetes.client.api.core_v1_api")
assert not loaded, f"imported {loaded}"
"""


def test_the_operator_never_imports_the_core_v1_api_module():
    subprocess.run([sys.executable, "-c", CODE], check=True, timeout=120)
