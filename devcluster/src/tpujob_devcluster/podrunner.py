"""Pod runner: the devcluster's stand-in for kubelet + container runtime, on kwok's TPU nodes.

A pod bound to one of the devcluster's nodes runs as a local process:
- its image is mapped to a local entrypoint through devcluster/images.yaml;
- its env is the pod's env with downward-API fields resolved, plus the devcluster's stand-ins for
  the cloud (the GCS emulator) and for TPU chips (google.com/tpu: N -> N CPU devices for JAX);
- isolation: each pod gets its own loopback address (127.B.y.z: B is this runner's own block, unique
  on the machine, see AddressPool), its own UTS namespace (hostname)
  and mount namespace, in which /etc/hosts is the pod's subdomain's hosts file (the headless
  Service's DNS on GKE) and the ServiceAccount token is mounted where in-cluster clients look.
  Two jobs' pods bind the same ports on different addresses and never collide, and all traffic
  stays on loopback. Network namespaces would isolate more, but would need routes to reach the
  apiserver and the GCS emulator on the host's loopback;
- status goes back to the API as kubelet reports it: Running with podIP, then Succeeded/Failed with
  the real exit code (128+signal when killed); deleting the pod sends SIGTERM to the container's
  main process (its PID 1: what the runtime signals), then SIGKILL to all of it after the grace
  period, as kubelet does;
- restarts in place, as the 1.35 kubelet with ContainerRestartRules and
  RestartAllContainersOnContainerExits, for a pod with restartPolicy OnFailure or a container
  restartPolicy (restarts_in_place): a container that exits is started again in the same pod
  (same uid, address, directory and emptyDir volumes) when its restartPolicyRules or restartPolicy,
  else the pod's restartPolicy, say so (exit_action), after the kubelet's crash-loop back-off
  (restart_backoff); restartCount, lastState.terminated and state.waiting are reported as kubelet
  reports them. Only the pod's first container runs (init and sidecar containers are not run);
- when a container's main process exits, its whole process group is killed (a container's PID
  namespace dies with its PID 1): no child outlives it;
- emptyDir volumes live as long as the pod under <pod dir>/volumes/<uid>/<name> (medium Memory: a
  tmpfs, sizeLimit its size, mounted outside the container's mount namespace) and are bind-mounted at
  their volumeMounts' mountPath (created when missing: there is no image filesystem to hold it), unless
  the host has files there (hides_the_host: the host's filesystem is every container's image);
- PATH: the image's entries from the image table (`path`), the runner's PATH, then the folders of the
  binaries every image is expected to hold (--image-bin-dir: JobSet's in-place-restart agent and
  tpujob-init), so `command: [tpujob-init, in-place-restart-agent]` runs them;
- securityContext (runAsNonRoot, runAsUser, capabilities, seccomp) is not applied: every process
  runs as the runner's user, since the project's interpreter is not readable by other users. The
  apiserver's PodSecurity admission is the real check of the pod spec (on by default);
  automountServiceAccountToken: false is honoured (no token is mounted).
Logs: <state>/pods/<namespace>/<pod>/log (path printed by `make up`), log.previous for the container
before an in-place restart; `kubectl logs` reads them through kubeletlogs.py (the kubelet's endpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import ipaddress
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from tpujob_contract import TPU_RESOURCE, Env

from . import kubeletlogs

log = logging.getLogger("podrunner")
NODE_LABEL = "tpujob.dev/devcluster-node"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
REPO_ROOT = Path(__file__).resolve().parents[3]  # `{repo}` in the image table (as controlplane.REPO_ROOT)
_FIELD_REF = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_image_table(path: Path) -> list[tuple[str, list[str]]]:
    table = yaml.safe_load(path.read_text())["images"]
    return [(entry["pattern"], list(entry["entrypoint"])) for entry in table]


def load_image_paths(path: Path) -> list[tuple[str, list[str]]]:
    """Each image's extra PATH entries (`path` in the table): directories of its filesystem."""
    table = yaml.safe_load(path.read_text())["images"]
    return [(entry["pattern"], list(entry.get("path") or [])) for entry in table]


def load_image_workdirs(path: Path) -> list[tuple[str, str | None]]:
    """Each image's working directory (`workdir` in the table: the image's WORKDIR), where it names one."""
    table = yaml.safe_load(path.read_text())["images"]
    return [(entry["pattern"], entry.get("workdir")) for entry in table]


def image_workdir(image: str, workdirs: list[tuple[str, str | None]], python: str) -> str | None:
    """The first matching entry's working directory (None: the pod's own folder)."""
    found = next((workdir for pattern, workdir in workdirs if fnmatch.fnmatch(image, pattern)), None)
    return _expand(found, python) if found else None


def image_path(image: str, paths: list[tuple[str, list[str]]], python: str) -> list[str]:
    """The first matching entry's PATH entries; `{python_dir}` is the directory of the project's
    interpreter (its venv's bin: `python` there is that interpreter)."""
    found = next((entry for pattern, entry in paths if fnmatch.fnmatch(image, pattern)), [])
    return [_expand(part.replace("{python_dir}", str(Path(python).parent)), python) for part in found]


def _expand(part: str, python: str) -> str:
    """The image table's placeholders (devcluster/images.yaml)."""
    if part == "{python}":
        return python
    cache = os.environ.get("TPUJOB_CACHE") or str(Path.home() / ".cache" / "tpujob")
    return part.replace("{cache}", cache).replace("{repo}", str(REPO_ROOT))


def container_argv(container: dict[str, Any], images: list[tuple[str, list[str]]], python: str) -> list[str]:
    """Docker semantics: `command` replaces the image entrypoint, `args` follow it."""
    if container.get("command"):
        entrypoint = list(container["command"])
    else:
        found = next((entry for pattern, entry in images if fnmatch.fnmatch(container["image"], pattern)), None)
        if found is None:
            raise ValueError(f"image {container['image']!r} has no entry in the pod runner's image table")
        entrypoint = [_expand(part, python) for part in found]
    return entrypoint + list(container.get("args") or [])


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_var_refs(argv: list[str], env: dict[str, str]) -> list[str]:
    """kubelet's $(VAR) expansion in command and args: a defined variable is replaced, `$$` is a
    literal `$`, anything else stays as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return [_VAR_REF.sub(one, part) for part in argv]


def resolve_field_ref(pod: dict[str, Any], path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    match = _FIELD_REF.match(path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise ValueError(f"unsupported fieldRef {path!r}")


def container_env(pod: dict[str, Any], container: dict[str, Any], extra: dict[str, str]) -> dict[str, str]:
    """Pod env resolved like kubelet does (later duplicates win), on top of the runner's extras."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", **extra}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif (source := item.get("valueFrom") or {}).get("fieldRef"):
            env[item["name"]] = resolve_field_ref(pod, source["fieldRef"]["fieldPath"])
        else:
            raise ValueError(f"env {item['name']}: only value and fieldRef are supported by the pod runner")
    return env


def process_compile_cache(env: dict[str, str], root: Path) -> dict[str, str]:
    """The CPU stand-in for a TPU slice's shared compilation cache: a JAX process of several reads what
    the process of its index compiled before, in `root/process<index>` as its own tier.

    On TPU every host of a slice shape computes the same cache keys, so a new attempt's processes read the
    shared tier. XLA's CPU keys differ per process index, and with several CPU processes the trainer turns
    the shared tier off (library/src/tpujob/compile_cache.py); the same index computes the same keys, so
    this gives back what the TPU hosts have. None where the pod sets its own tier (an InPlace job's
    volume, which a new pod starts empty) or runs one process."""
    from tpujob.config import ConfigError, topology_from_env  # imports JAX: only where this is asked for

    if Env.LOCAL_COMPILATION_CACHE_DIR in env:
        return {}
    try:
        topology = topology_from_env(env)  # the trainer's own rule for its process index
    except ConfigError:
        return {}  # the trainer reports its env itself
    if topology.num_processes < 2:
        return {}
    return {Env.LOCAL_COMPILATION_CACHE_DIR: str(root / f"process{topology.process_id}")}


def tpu_chips(container: dict[str, Any]) -> int:
    limits = (container.get("resources") or {}).get("limits") or {}
    return int(limits.get(TPU_RESOURCE, 0))


# -- restarts in place, as the 1.35 kubelet ---------------------------------------------------------
RESTART = "Restart"
RESTART_ALL = "RestartAllContainers"
# The kubelet's crash-loop back-off with the gates the devcluster enables (ReduceDefaultCrashLoopBackOffDecay
# off: pkg/kubelet/kubelet.go initialCrashLoopBackOff, MaxContainerBackOff): 10 s doubling to 5 min,
# forgotten once a container ran for twice the maximum.
BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0
ALL_CONTAINERS_RESTARTING = "AllContainersRestarting"  # the pod condition the action sets


def matching_restart_rule(container: dict[str, Any], exit_code: int) -> dict[str, Any] | None:
    """podutil.FindMatchingContainerRestartRule: the first rule whose exitCodes In/NotIn matches."""
    for rule in container.get("restartPolicyRules") or []:
        codes = rule.get("exitCodes")
        if not codes:
            continue
        listed = exit_code in (codes.get("values") or [])
        if (codes.get("operator") == "In" and listed) or (codes.get("operator") == "NotIn" and not listed):
            return dict(rule)
    return None


def exit_action(pod_spec: dict[str, Any], container: dict[str, Any], exit_code: int) -> str | None:
    """podutil.ContainerShouldRestart with both gates on: RESTART, RESTART_ALL or None (the container
    stays terminated). The container's restartPolicy (with its rules) wins over the pod's."""
    own = container.get("restartPolicy")
    if own is not None:
        rule = matching_restart_rule(container, exit_code)
        if rule is not None and rule.get("action") in (RESTART, RESTART_ALL):
            return str(rule["action"])
        if own == "Always" or (own == "OnFailure" and exit_code != 0):
            return RESTART
        if own in ("Never", "OnFailure"):
            return None
    policy = pod_spec.get("restartPolicy") or "Always"
    if policy == "Always" or (policy == "OnFailure" and exit_code != 0):
        return RESTART
    return None


def restarts_in_place(pod_spec: dict[str, Any], container: dict[str, Any]) -> bool:
    """Whether the runner restarts this pod's container at all: with restartPolicy OnFailure or a
    container restartPolicy (JobSet's in-place restart uses one of the two). A pod with restartPolicy
    Always and no container policy (a Deployment's: the operator's) still ends Failed when its process
    exits and its ReplicaSet replaces it, as before: the operator's fail-over tests count on a new
    pod (a kubelet would restart it in place)."""
    return pod_spec.get("restartPolicy") == "OnFailure" or container.get("restartPolicy") is not None


def could_restart_all(pod_spec: dict[str, Any]) -> bool:
    """podutil.AllContainersCouldRestart: only such pods carry the AllContainersRestarting condition."""
    containers = (pod_spec.get("initContainers") or []) + (pod_spec.get("containers") or [])
    return any(r.get("action") == RESTART_ALL for c in containers for r in c.get("restartPolicyRules") or [])


@dataclass(frozen=True)
class Backoff:
    """One container's entry in the kubelet's crash-loop back-off (client-go flowcontrol.Backoff)."""

    period: float
    last_update: float


def restart_backoff(
    entry: Backoff | None,
    finished_at: float,
    now_s: float,
    initial: float = BACKOFF_INITIAL_S,
    maximum: float = BACKOFF_MAX_S,
) -> tuple[float, Backoff]:
    """(seconds to wait before the restart, the entry after it), as kubelet's doBackOff: the first
    restart (or the first after a quiet 2 x maximum) is immediate and arms `initial`; each later one
    waits out the armed period counted from the exit, then doubles it, up to `maximum`."""
    if entry is None or finished_at - entry.last_update > 2 * maximum:
        return 0.0, Backoff(initial, now_s)
    delay = max(0.0, entry.period - (now_s - finished_at))
    return delay, Backoff(min(entry.period * 2, maximum), now_s + delay)


def container_status(
    container: dict[str, Any],
    state: dict[str, Any],
    restart_count: int = 0,
    last_terminated: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One entry of status.containerStatuses, as kubelet writes it. Once the container restarted, the
    state's other keys are sent as null: a strategic merge would otherwise keep an earlier state's."""
    running = "running" in state
    if restart_count:
        state = {key: state.get(key) for key in ("running", "waiting", "terminated")}
    status: dict[str, Any] = {
        "name": container.get("name", ""),
        "ready": running,
        "restartCount": restart_count,
        "image": container.get("image", ""),
        "imageID": "",
        "started": running,
        "state": state,
    }
    if last_terminated:
        status["lastState"] = {"terminated": last_terminated}
    return status


def terminal_phase(exit_code: int) -> str:
    """The phase of a pod whose container will not run again (it ended for good, or its pod is being
    deleted): the kubelet's rule for a terminal pod, whatever its restartPolicy."""
    return "Succeeded" if exit_code == 0 else "Failed"


def pod_status(
    phase: str,
    container: dict[str, Any],
    state: dict[str, Any],
    at: str,
    ip: str | None = None,
    start_time: str | None = None,
    restart_count: int = 0,
    last_terminated: dict[str, Any] | None = None,
    restarting_all: bool | None = None,
) -> dict[str, Any]:
    """The pod status kubelet reports. `restarting_all`: None leaves out AllContainersRestarting
    (a pod without a RestartAllContainers rule), else that condition's status."""
    ready = "True" if phase == "Running" and "running" in state else "False"
    conditions = [
        {"type": t, "status": ready if t in ("Ready", "ContainersReady") else "True", "lastTransitionTime": at}
        for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
    ]
    if restarting_all is not None:
        condition: dict[str, Any] = {
            "type": ALL_CONTAINERS_RESTARTING,
            "status": "True" if restarting_all else "False",
            "lastTransitionTime": at,
        }
        if restarting_all:
            condition.update(reason="RestartAllContainersStarted", message="container exited with restart policy rule")
        conditions.append(condition)
    status: dict[str, Any] = {
        "phase": phase,
        "hostIP": "127.0.0.1",
        "conditions": conditions,
        "containerStatuses": [container_status(container, state, restart_count, last_terminated)],
    }
    if ip:
        status.update(podIP=ip, podIPs=[{"ip": ip}])
    if start_time:
        status["startTime"] = start_time
    return status


# -- emptyDir volumes -------------------------------------------------------------------------------
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(quantity: str) -> int:
    match = _QUANTITY.match(str(quantity))
    if not match:
        raise ValueError(f"unsupported quantity {quantity!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@dataclass(frozen=True)
class VolumeMount:
    name: str
    source: Path  # the pod's directory of the volume (lives as long as the pod)
    mount_path: str
    memory: bool  # medium: Memory, a tmpfs
    size_bytes: int | None  # sizeLimit (a tmpfs' size; kubelet's default for Memory is the node's memory)
    read_only: bool = False


def empty_dir_mounts(pod_spec: dict[str, Any], container: dict[str, Any], volumes_dir: Path) -> list[VolumeMount]:
    """The container's volumeMounts of the pod's emptyDir volumes (other volume types are not run)."""
    empty_dirs = {v["name"]: v["emptyDir"] for v in pod_spec.get("volumes") or [] if v.get("emptyDir") is not None}
    mounts = []
    for mount in container.get("volumeMounts") or []:
        source = empty_dirs.get(mount["name"])
        if source is None:
            continue
        if mount.get("subPath"):
            raise ValueError(f"volumeMount {mount['name']}: subPath is not supported by the pod runner")
        size = source.get("sizeLimit")
        mounts.append(
            VolumeMount(
                name=mount["name"],
                source=volumes_dir / mount["name"],
                mount_path=mount["mountPath"],
                memory=source.get("medium") == "Memory",
                size_bytes=quantity_bytes(size) if size is not None else None,
                read_only=bool(mount.get("readOnly")),
            )
        )
    return mounts


def prepare_volumes(mounts: list[VolumeMount]) -> None:
    """The pod's volume directories; a Memory one is a tmpfs mounted here, in the runner's (the
    host's) mount namespace, so that it outlives each container and goes with the pod."""
    for m in mounts:
        m.source.mkdir(parents=True, exist_ok=True)
        if m.memory and not os.path.ismount(m.source):
            options = f"size={m.size_bytes}" if m.size_bytes else "size=50%"
            subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(m.source)], check=True)


def release_volumes(mounts: list[VolumeMount], volumes_dir: Path | None) -> None:
    """The pod is gone: unmount its tmpfs volumes (lazily: a dying process may still hold one), drop the data."""
    for m in mounts:
        if m.memory and os.path.ismount(m.source):
            subprocess.run(["umount", "-l", str(m.source)], check=False)
    if volumes_dir is not None:
        shutil.rmtree(volumes_dir, ignore_errors=True)


def release_mounts_under(root: Path) -> None:
    """Unmount whatever an earlier runner, killed before it could, left mounted under `root`."""
    prefix = str(root.resolve()) + "/"
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in sorted((p for p in points if p.startswith(prefix)), reverse=True):
        subprocess.run(["umount", "-l", point], check=False)


def hides_the_host(mount_path: str) -> bool:
    """Whether a volume at `mount_path` would hide what the host has there. The host's filesystem is
    every container's image here: a volume over a non-empty directory (the chart's emptyDir at /tmp,
    with a checkout and its venv under /tmp) would hide the container's own interpreter."""
    path = Path(mount_path)
    return path.is_dir() and any(path.iterdir())


def mount_commands(mounts: list[VolumeMount]) -> list[str]:
    """Shell, run in the container's new mount namespace: bind each volume at its mountPath, unless it
    would hide the host's files there (the container then shares the host's directory, as before
    volumes were mounted)."""
    commands = []
    for m in mounts:
        if hides_the_host(m.mount_path):
            log.warning("volume %s not mounted at %s: the host has files there", m.source, m.mount_path)
            continue
        target = shlex.quote(m.mount_path)
        commands.append(f"mkdir -p {target} && mount --bind {shlex.quote(str(m.source))} {target}")
        if m.read_only:
            commands.append(f"mount -o remount,bind,ro {target}")
    return commands


@dataclass
class RunningPod:
    uid: str
    namespace: str
    name: str
    ip: str
    directory: Path
    process: subprocess.Popen[bytes]
    started_at: str
    hosts_file: Path
    hostname_fqdn: str
    killed_for_deletion: bool = False
    vanished: bool = False  # the pod or its node left the API: nobody is left to report to
    finished: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # What a restart in place needs: the container's launch, its restarts, its back-off, its volumes.
    launch: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restart_count: int = 0
    backoff: Backoff | None = None
    volumes: list[VolumeMount] = field(default_factory=list)
    volumes_dir: Path | None = None
    wake: threading.Event = field(default_factory=threading.Event)  # ends a back-off wait (deletion)
    last_terminated: dict[str, Any] | None = None  # lastState.terminated once it restarted


# Every devcluster on this machine shares the loopback interface, and a coordinator port is the
# same in every job (jobset.COORDINATOR_PORT). gRPC listens with SO_REUSEPORT, so two pods given
# one address by two pod runners both bind <address>:8476 without an error, and the kernel deals
# connections between the two JAX coordinators: one job's workers register at the other's (issue 17,
# item 14). Each pod runner therefore claims a /16 of its own for as long as it runs.
ADDRESS_LOCKS = Path(tempfile.gettempdir()) / "tpujob-loopback-blocks"
# 127.<block>.0.0/16: 127.0.0.0/16 stays the host's, and 127.1.0.0/16 is what every pod runner
# before these blocks handed out (one may still run on this machine).
_BLOCKS = range(2, 255)


def addresses_in_use() -> set[str]:
    """Local IPv4 addresses of every TCP socket on this machine (any process, any state), from
    /proc/net/tcp and /proc/net/tcp6 (v4-mapped): a pod of a runner that died may still hold one."""
    found: set[str] = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                local = line.split()[1].split(":")[0]
                if width == 32 and not local.startswith("0000000000000000FFFF0000"):
                    continue
                found.add(str(ipaddress.IPv4Address(bytes.fromhex(local[-8:])[::-1])))
    return found


class AddressPool:
    """Unique loopback addresses for pods, machine-wide: this runner's own block 127.B.0.0/16 (held
    by an exclusive lock on ADDRESS_LOCKS/B while the runner lives; the kernel releases it when the
    runner dies), handed out in order, skipping any address a socket on this machine still uses."""

    def __init__(self, lock_dir: Path = ADDRESS_LOCKS) -> None:
        self._lock = threading.Lock()
        self.block, self._lock_file = _claim_block(lock_dir)
        self._next = 0

    def take(self) -> str:
        with self._lock:
            in_use = addresses_in_use()
            for _ in range(256 * 254):
                self._next = self._next % (256 * 254) + 1  # 127.B.0.1 .. 127.B.254.254
                high, low = divmod(self._next - 1, 254)
                address = f"127.{self.block}.{high}.{low + 1}"
                if address not in in_use:
                    return address
            raise RuntimeError(f"every address of 127.{self.block}.0.0/16 is in use")

    def close(self) -> None:
        self._lock_file.close()


def _claim_block(lock_dir: Path) -> tuple[int, IO[str]]:
    lock_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        lock_dir.chmod(0o1777)  # every user's devclusters claim blocks here
    for block in _BLOCKS:
        path = lock_dir / str(block)
        try:
            handle = path.open("a")
        except OSError:
            continue  # another user's lock file we may not open: taken for our purposes
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        with contextlib.suppress(OSError):
            path.chmod(0o666)
        return block, handle
    raise RuntimeError(f"all {len(_BLOCKS)} loopback blocks are claimed by other pod runners ({lock_dir})")


def _rewrite(path: Path, lines: list[str]) -> None:
    # Rewritten in place (not renamed): the file is bind-mounted by inode into running pods.
    with path.open("r+" if path.exists() else "w") as handle:
        handle.seek(0)
        handle.write("\n".join(lines) + "\n")
        handle.truncate()


class PodRunner:
    def __init__(
        self,
        state_dir: Path,
        images: Path,
        extra_env: dict[str, str],
        api_port: int,
        cpu_devices_per_pod: int,
        image_bin_dirs: list[Path] | None = None,
        process_compile_cache_root: Path | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.cpu_devices_per_pod = cpu_devices_per_pod
        self.images = load_image_table(images)
        self.image_paths = load_image_paths(images)
        self.image_workdirs = load_image_workdirs(images)
        self.image_bin_dirs = image_bin_dirs or []
        self.extra_env = extra_env
        self.process_compile_cache_root = process_compile_cache_root  # see process_compile_cache
        self.api_port = api_port
        self.core = client.CoreV1Api()
        self.addresses = AddressPool()
        self.pods: dict[str, RunningPod] = {}
        self.hosts_lock = threading.Lock()
        # An earlier runner's hosts files name addresses it no longer holds (another runner may hand
        # them out now): a peer must never resolve a name to a stale address. No pod runs yet.
        shutil.rmtree(self.state_dir / "hosts", ignore_errors=True)
        release_mounts_under(self.state_dir / "pods")  # an earlier runner's tmpfs volumes, if it was killed
        self.stopping = threading.Event()

    # -- hosts files: the stand-in for the headless Service's DNS records -------------------------
    def _hosts_path(self, namespace: str, subdomain: str | None, pod_name: str) -> Path:
        key = f"{namespace}_{subdomain}" if subdomain else f"{namespace}_pod_{pod_name}"
        return self.state_dir / "hosts" / key

    def _add_host(self, path: Path, ip: str, names: list[str]) -> None:
        with self.hosts_lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            lines = path.read_text().splitlines() if path.exists() else ["127.0.0.1 localhost"]
            # A pod name seen again (a replacement pod) takes its new address: drop the old line.
            lines = [line for line in lines if names[0] not in line.split()[1:]]
            lines.append(f"{ip} {' '.join(names)}")
            _rewrite(path, lines)

    def _remove_host(self, path: Path, ip: str) -> None:
        """A pod that ended leaves its subdomain's DNS (its address goes back to the pool)."""
        with self.hosts_lock, contextlib.suppress(FileNotFoundError):
            _rewrite(path, [line for line in path.read_text().splitlines() if line.split()[:1] != [ip]])

    # -- lifecycle ----------------------------------------------------------------------------------
    def start_pod(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        container = spec["containers"][0]
        directory = self.state_dir / "pods" / namespace / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / kubeletlogs.CONTAINER_FILE).write_text(container["name"])
        ip = self.addresses.take()
        hostname = spec.get("hostname") or name
        subdomain = spec.get("subdomain")
        fqdn = f"{hostname}.{subdomain}.{namespace}.svc.cluster.local" if subdomain else hostname
        names = [fqdn, f"{hostname}.{subdomain}", hostname] if subdomain else [hostname]
        hosts_file = self._hosts_path(namespace, subdomain, name)
        pod.setdefault("status", {})["podIP"] = ip
        try:
            argv = container_argv(container, self.images, sys.executable)
            extra = {
                **self.extra_env,
                "HOSTNAME": hostname,
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": str(self.api_port),
            }
            chips = tpu_chips(container)
            if chips:  # a TPU host becomes a JAX process with CPU devices standing in for its chips
                devices = chips if self.cpu_devices_per_pod == 0 else min(chips, self.cpu_devices_per_pod)
                extra.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
            path = [*image_path(container["image"], self.image_paths, sys.executable), os.environ.get("PATH", "")]
            path.extend(str(d) for d in self.image_bin_dirs)
            extra["PATH"] = ":".join(p for p in path if p)
            env = container_env(pod, container, extra)
            if chips and self.process_compile_cache_root is not None:
                env |= process_compile_cache(env, self.process_compile_cache_root)
            argv = expand_var_refs(argv, env)
            volumes_dir = directory / "volumes" / uid
            volumes = empty_dir_mounts(spec, container, volumes_dir)
            token_dir = self._service_account(pod, directory)
            prepare_volumes(volumes)
        except (ValueError, ApiException, subprocess.CalledProcessError) as error:
            self._report(pod, "Failed", terminated={"exitCode": 128, "reason": "StartError", "message": str(error)})
            log.warning("%s/%s cannot start: %s", namespace, name, getattr(error, "body", None) or error)
            return
        self._add_host(hosts_file, ip, names)
        mounts = f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts"
        if token_dir:
            mounts += f" && mkdir -p {SA_MOUNT} && mount --bind {shlex.quote(str(token_dir))} {SA_MOUNT}"
        mounts = " && ".join([mounts, *mount_commands(volumes)])
        workdir = image_workdir(container["image"], self.image_workdirs, sys.executable)
        enter = f"cd {shlex.quote(workdir)} && " if workdir else ""
        script = f'hostname {shlex.quote(hostname)} && {mounts} && {enter}exec "$@"'
        launch = ["unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c", script, "pod", *argv]
        process = self._spawn(directory, launch, env)
        running = RunningPod(uid, namespace, name, ip, directory, process, now(), hosts_file, fqdn)
        running.launch, running.env, running.volumes, running.volumes_dir = launch, env, volumes, volumes_dir
        self.pods[uid] = running
        self._report(pod, "Running", ip=ip, started_at=running.started_at)
        log.info("started %s/%s as pid %d on %s (%s)", namespace, name, process.pid, ip, " ".join(argv[:4]))
        threading.Thread(target=self._wait_for_exit, args=(running, pod), daemon=True).start()

    @staticmethod
    def _spawn(directory: Path, launch: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """The container's main process, leading a process group of its own (the pid file names it)."""
        with (directory / kubeletlogs.LOG_FILE).open("ab") as log_file:
            process = subprocess.Popen(
                launch,
                cwd=directory,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (directory / "pid").write_text(str(process.pid))
        return process

    def _service_account(self, pod: dict[str, Any], directory: Path) -> Path | None:
        spec = pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        account = spec.get("serviceAccountName") or "default"
        request: Any = {
            "spec": {
                "audiences": [],
                "expirationSeconds": 86400,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": pod["metadata"]["name"],
                    "uid": pod["metadata"]["uid"],
                },
            }
        }
        token: Any = self.core.create_namespaced_service_account_token(account, pod["metadata"]["namespace"], request)
        token_dir = directory / "serviceaccount"
        token_dir.mkdir(exist_ok=True)
        (token_dir / "token").write_text(token.status.token)
        (token_dir / "namespace").write_text(pod["metadata"]["namespace"])
        ca = Path(client.Configuration.get_default_copy().ssl_ca_cert or "")
        (token_dir / "ca.crt").write_bytes(ca.read_bytes() if ca.is_file() else b"")
        return token_dir

    def _wait_for_exit(self, running: RunningPod, pod: dict[str, Any]) -> None:
        container = pod["spec"]["containers"][0]
        while True:
            code = running.process.wait()
            # A container's PID namespace dies with its PID 1: nothing it started outlives it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(running.process.pid, signal.SIGKILL)
            exit_code = code if code >= 0 else 128 - code  # killed by signal N: 128+N, as runtimes report
            finished = time.monotonic()
            terminated = {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "startedAt": running.started_at,
                "finishedAt": now(),
            }
            log.info("%s/%s exited with %d", running.namespace, running.name, exit_code)
            in_place = restarts_in_place(pod["spec"], container) and not running.killed_for_deletion
            action = exit_action(pod["spec"], container, exit_code) if in_place else None
            if running.vanished or action is None:
                break
            if not self._restart(running, pod, container, action, terminated, finished):
                break
        self._remove_host(running.hosts_file, running.ip)
        with running.lock:
            running.finished = True
        if running.vanished:
            release_volumes(running.volumes, running.volumes_dir)
            return
        if running.killed_for_deletion:
            self._finish_deletion(running, terminated)
            return
        self._report(pod, terminal_phase(exit_code), ip=running.ip, terminated=terminated, running=running)

    def _restart(
        self,
        running: RunningPod,
        pod: dict[str, Any],
        container: dict[str, Any],
        action: str,
        terminated: dict[str, Any],
        finished: float,
    ) -> bool:
        """Start the container again in the same pod, as kubelet; False when the pod went meanwhile."""
        restart_all = could_restart_all(pod["spec"])
        if action == RESTART_ALL:
            # Every container is killed and removed, so none is in back-off; the pod condition says so
            # until they run again. The container that exited keeps its own exit as its last state; only
            # one killed while running would read RestartingAllContainers/137 (kubelet_pods.go), and the
            # runner runs one container per pod.
            self._report_restart(pod, running, {"terminated": terminated}, running.last_terminated, True)
            delay = 0.0
        else:
            delay, running.backoff = restart_backoff(running.backoff, finished, time.monotonic())
        running.restart_count += 1
        running.last_terminated = terminated
        if delay > 0:
            waiting = {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:.0f}s restarting failed container={container['name']} pod={running.name}",
            }
            self._report_restart(pod, running, {"waiting": waiting}, terminated, False if restart_all else None)
            running.wake.wait(delay)
        with running.lock:
            if running.killed_for_deletion or running.vanished:
                return False
            running.started_at = now()
            # The kubelet keeps the last terminated instance's log (kubectl logs --previous).
            log_path = running.directory / kubeletlogs.LOG_FILE
            if log_path.exists():
                log_path.replace(running.directory / kubeletlogs.PREVIOUS_LOG_FILE)
            running.process = self._spawn(running.directory, running.launch, running.env)
        log.info(
            "restarted %s/%s in place (%s, restart %d)", running.namespace, running.name, action, running.restart_count
        )
        state = {"running": {"startedAt": running.started_at}}
        self._report_restart(pod, running, state, terminated, False if restart_all else None)
        return True

    def _report_restart(
        self,
        pod: dict[str, Any],
        running: RunningPod,
        state: dict[str, Any],
        last: dict[str, Any] | None,
        restarting_all: bool | None,
    ) -> None:
        status = pod_status(
            "Running",
            pod["spec"]["containers"][0],
            state,
            now(),
            ip=running.ip,
            restart_count=running.restart_count,
            last_terminated=last,
            restarting_all=restarting_all,
        )
        try:
            self.core.patch_namespaced_pod_status(
                running.name,
                running.namespace,
                {"status": status},
                _content_type="application/strategic-merge-patch+json",
            )
        except ApiException as error:
            if error.status != 404:
                log.warning("status of %s/%s: %s", running.namespace, running.name, error)

    def _finish_deletion(self, running: RunningPod, terminated: dict[str, Any]) -> None:
        try:
            phase = terminal_phase(terminated["exitCode"])
            self._patch_status(
                running.namespace, running.name, phase, running.ip, terminated=terminated, running=running
            )
            self.core.delete_namespaced_pod(running.name, running.namespace, grace_period_seconds=0)
        except ApiException as error:
            if error.status != 404:
                log.warning("finishing deletion of %s/%s: %s", running.namespace, running.name, error)
        release_volumes(running.volumes, running.volumes_dir)
        self.pods.pop(running.uid, None)

    def delete_pod(self, running: RunningPod, grace_seconds: int) -> None:
        """kubelet's graceful deletion: SIGTERM now, SIGKILL after the grace period."""
        with running.lock:
            if running.killed_for_deletion:
                return
            running.killed_for_deletion = True
            running.wake.set()  # a container waiting out a back-off is not started again
            if running.finished:
                self._finish_deletion(running, {"exitCode": running.process.returncode or 0, "reason": "Completed"})
                return
        with contextlib.suppress(ProcessLookupError):
            os.kill(running.process.pid, signal.SIGTERM)

        def escalate() -> None:
            try:
                running.process.wait(grace_seconds)
            except subprocess.TimeoutExpired:
                self._signal(running, signal.SIGKILL)

        threading.Thread(target=escalate, daemon=True).start()

    @staticmethod
    def _signal(running: RunningPod, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(running.process.pid, sig)

    # -- status reports ------------------------------------------------------------------------------
    def _report(
        self,
        pod: dict[str, Any],
        phase: str,
        ip: str | None = None,
        started_at: str | None = None,
        terminated: dict[str, Any] | None = None,
        running: RunningPod | None = None,
    ) -> None:
        meta = pod["metadata"]
        try:
            self._patch_status(meta["namespace"], meta["name"], phase, ip, started_at, terminated, running)
        except ApiException as error:
            if error.status != 404:
                log.warning("status of %s/%s: %s", meta["namespace"], meta["name"], error)

    def _patch_status(
        self,
        namespace: str,
        name: str,
        phase: str,
        ip: str | None,
        started_at: str | None = None,
        terminated: dict[str, Any] | None = None,
        running: RunningPod | None = None,
    ) -> None:
        state = {"terminated": terminated} if terminated else {"running": {"startedAt": started_at or now()}}
        pod: Any = self.core.read_namespaced_pod(name, namespace)
        spec = self.core.api_client.sanitize_for_serialization(pod.spec)
        restarts = running.restart_count if running is not None else 0
        status = pod_status(
            phase,
            spec["containers"][0],
            state,
            now(),
            ip=ip,
            start_time=started_at,
            restart_count=restarts,
            last_terminated=running.last_terminated if running is not None else None,
            restarting_all=False if restarts and could_restart_all(spec) else None,
        )
        # Strategic merge, as kubelet's status manager: conditions merge by type, so a DisruptionTarget
        # set by the control plane (eviction, preemption, pod GC) survives this report.
        self.core.patch_namespaced_pod_status(
            name, namespace, {"status": status}, _content_type="application/strategic-merge-patch+json"
        )

    # -- the loop ------------------------------------------------------------------------------------
    # The passes read the API's JSON as it comes: the client's models cost about a millisecond an
    # object each way, which at 1,000 pods and nodes took the 2 cores a kubelet's reports wait for.
    def managed_nodes(self) -> set[str]:
        response: Any = self.core.list_node(label_selector=NODE_LABEL, _preload_content=False)
        return {str(n["metadata"]["name"]) for n in json.loads(response.data)["items"]}

    def sync_once(self) -> None:
        nodes = self.managed_nodes()
        response: Any = self.core.list_pod_for_all_namespaces(field_selector="spec.nodeName!=", _preload_content=False)
        seen = set()
        for pod in json.loads(response.data)["items"]:
            uid, meta = pod["metadata"]["uid"], pod["metadata"]
            if pod["spec"].get("nodeName") not in nodes:
                continue
            seen.add(uid)
            running = self.pods.get(uid)
            if meta.get("deletionTimestamp"):
                if running is not None:
                    self.delete_pod(running, int(meta.get("deletionGracePeriodSeconds") or 30))
                elif (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed", None, "Pending"):
                    self._force_delete(meta)
                continue
            phase = (pod.get("status") or {}).get("phase")
            if running is None and phase in (None, "Pending"):
                self.start_pod(pod)
            elif running is None and phase == "Running":  # started by an earlier runner, whose pods died with it
                self._report(
                    pod, "Failed", terminated={"exitCode": 137, "reason": "Error", "message": "pod runner restarted"}
                )
        # Force-deleted in the API, or its node is gone (a lost VM): the process dies without a word.
        for uid in [u for u in self.pods if u not in seen]:
            running = self.pods.pop(uid)
            with running.lock:
                running.vanished = True
            running.wake.set()
            self._signal(running, signal.SIGKILL)
            if running.finished:  # no exit is left to wait for: its volumes go now
                release_volumes(running.volumes, running.volumes_dir)

    def _force_delete(self, meta: dict[str, Any]) -> None:
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=0)
        except ApiException as error:
            if error.status != 404:
                raise

    def container_running(self, namespace: str, name: str) -> bool:
        """Whether the pod's container runs now (a `kubectl logs -f` follows it until it stops)."""
        return any(
            p.namespace == namespace and p.name == name and not p.finished and p.process.poll() is None
            for p in list(self.pods.values())
        )

    def run(self, interval: float) -> None:
        while not self.stopping.is_set():
            try:
                self.sync_once()
            except Exception:  # the API may blip; the next pass retries everything
                log.exception("sync failed")
            self.stopping.wait(interval)
        self.stop_all()

    def stop_all(self) -> None:
        for running in list(self.pods.values()):
            with running.lock:  # no container starts again (a restart spawns under this lock)
                running.vanished = True
            running.wake.set()
            self._signal(running, signal.SIGKILL)
            running.process.wait()
            release_volumes(running.volumes, running.volumes_dir)
        self.addresses.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--api-port", type=int, required=True)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE added to every pod")
    parser.add_argument(
        "--image-bin-dir",
        type=Path,
        action="append",
        default=[],
        help="a folder of binaries every image holds (JobSet's agent, tpujob-init), on every pod's PATH",
    )
    parser.add_argument(
        "--process-compile-cache",
        type=Path,
        help="the CPU stand-in for a TPU slice's shared compilation cache (process_compile_cache): a folder",
    )
    parser.add_argument("--interval", type=float, default=0.3)
    parser.add_argument(
        "--cpu-devices-per-pod",
        type=int,
        default=1,
        help="CPU devices standing in for a TPU host's chips (0: one per chip). On 2 cores, 16 devices "
        "in 4 processes spend their time in cross-process collectives; 1 keeps the demo quick.",
    )
    parser.add_argument("--logs-port", type=int, help="serve the kubelet's containerLogs endpoint on this port")
    parser.add_argument("--tls-cert", type=Path, help="the logs endpoint's serving certificate and key")
    parser.add_argument("--tls-key", type=Path)
    parser.add_argument("--client-ca", type=Path, help="the CA the apiserver's client certificate must be of")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config.load_kube_config(args.kubeconfig)
    extra = dict(item.split("=", 1) for item in args.env)
    runner = PodRunner(
        args.state_dir,
        args.images,
        extra,
        args.api_port,
        args.cpu_devices_per_pod,
        args.image_bin_dir,
        args.process_compile_cache,
    )
    if args.logs_port:
        context = kubeletlogs.server_context(args.tls_cert, args.tls_key, args.client_ca)
        kubeletlogs.serve(args.state_dir / "pods", args.logs_port, context, runner.container_running, runner.stopping)
    signal.signal(signal.SIGTERM, lambda *_: runner.stopping.set())
    runner.run(args.interval)


if __name__ == "__main__":
    main()
