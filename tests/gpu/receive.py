"""On the GPU machine: collects the bundle's parts (tests/gpu/bundle.py), one per call, and
unpacks the whole once every part is there and its sha256 matches. Standard library only:
it runs before anything is installed.

python3 -m tests.gpu.receive .gpu-bundle/part-K [--into /var/tmp/llmserve-gpu]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path

DEFAULT_INTO = Path("/var/tmp/llmserve-gpu")


def receive(part: Path, into: Path) -> bool:
    """Stores one part; unpacks into `into`/bundle when all are there. True once unpacked."""
    manifest = json.loads((part / "manifest.json").read_text())
    store = into / "parts" / manifest["sha256"][:16]
    store.mkdir(parents=True, exist_ok=True)
    for chunk in part.glob("bundle.tar.*"):
        shutil.copyfile(chunk, store / chunk.name)
    have = sorted(store.glob("bundle.tar.*"), key=lambda p: int(p.suffix[1:]))
    print(f"bundle {manifest['sha256'][:16]}: {len(have)} of {manifest['parts']} parts here")
    if len(have) < manifest["parts"]:
        return False
    digest, whole = hashlib.sha256(), into / "bundle.tar"
    with open(whole, "wb") as out:
        for chunk in have:
            data = chunk.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != manifest["sha256"]:
        raise SystemExit("the parts do not make the bundle (sha256 differs): send them again")
    target = into / "bundle"
    shutil.rmtree(target, ignore_errors=True)
    with tarfile.open(whole) as tar:
        tar.extractall(target, filter="data")
    whole.unlink()
    print(f"unpacked into {target}: make test-gpu GPU_BUNDLE={target}")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", type=Path)
    parser.add_argument("--into", type=Path, default=DEFAULT_INTO)
    args = parser.parse_args()
    receive(args.part, args.into)


if __name__ == "__main__":
    sys.exit(main())
