"""deploy/k8s rendered by kustomize (kubectl's), as objects."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

K8S_DIR = Path(__file__).resolve().parents[1] / "deploy" / "k8s"


def render(directory: Path = K8S_DIR) -> list[dict]:
    """`kubectl kustomize directory`."""
    out = subprocess.run(["kubectl", "kustomize", str(directory)], check=True,
                         capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_with_components(directory: Path, base: Path, components: list[Path]) -> list[dict]:
    """An overlay made in `directory`: base plus components (kustomize takes
    relative paths only)."""
    rel = lambda path: os.path.relpath(path, directory)  # noqa: E731
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [rel(base)], "components": [rel(c) for c in components]}))
    return render(directory)


def find(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def pod_templates(objects: list[dict]) -> dict[str, dict]:
    """Workload name -> its pod template."""
    return {o["metadata"]["name"]: o["spec"]["template"] for o in objects
            if o["kind"] in ("Deployment", "StatefulSet")}
