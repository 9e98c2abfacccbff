"""The Gateway API's schemas for tests, from the npm registry.

No package on PyPI, npm or Debian carries the Gateway API CRDs (`standard-install.yaml`), so
the test API server cannot serve HTTPRoute from its own CRD. The closest a registry has is
`@kubernetes-models/gateway-api` (MIT): JSON-schema validators generated from the Gateway
API's Go types (`sigs.k8s.io/gateway-api/apis/v1`). They check field types, required fields,
bounds, patterns and enums; they do not run the CRDs' CEL rules (a Service backendRef without
a port passes) and do not refuse unknown fields. Installed once with `npm install` into the
tests' cache, next to helm (`kcluster.helm.cache_dir`); concurrent callers serialise on a lock
file and the modules appear by atomic rename.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .helm import cache_dir

NPM_PACKAGE = "@kubernetes-models/gateway-api"
NPM_VERSION = "2.0.0"
# Reads [{apiVersion, kind, ...}, ...] on stdin; prints one error text (or null) per object.
VALIDATE_JS = """
let input = "";
for await (const chunk of process.stdin) input += chunk;
const answers = [];
for (const doc of JSON.parse(input)) {
  const [group, version] = String(doc.apiVersion).split("/");
  try {
    const module = await import(`@kubernetes-models/gateway-api/${group}/${version}/${doc.kind}`);
    new module[doc.kind](doc).validate();
    answers.push(null);
  } catch (error) {
    answers.push(String(error.message));
  }
}
console.log(JSON.stringify(answers));
"""


def validate(objects: list[dict[str, Any]]) -> list[str | None]:
    """For each Gateway API object, None when the schema accepts it, else the errors (a
    model that does not exist, such as a wrong kind or version, is an error too)."""
    done = subprocess.run(["node", "--input-type=module", "-e", VALIDATE_JS],
                          input=json.dumps(objects), capture_output=True, text=True,
                          timeout=60, check=False, cwd=models_folder())
    if done.returncode != 0:
        raise RuntimeError(f"node failed with exit code {done.returncode}:\n{done.stderr}")
    return json.loads(done.stdout)


def models_folder() -> Path:
    """A folder whose node_modules holds the package; installs it on first use."""
    folder = cache_dir() / "gateway-api-models" / NPM_VERSION
    if _installed(folder):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _installed(folder):  # another process may have finished while we waited
            _install(folder)
    return folder


def _installed(folder: Path) -> bool:
    return (folder / "node_modules" / NPM_PACKAGE / "package.json").is_file()


def _install(folder: Path) -> None:
    command = ["npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix"]
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        try:
            done = subprocess.run([*command, tmp, f"{NPM_PACKAGE}@{NPM_VERSION}"],
                                  capture_output=True, text=True, timeout=600, check=False)
        except FileNotFoundError as exc:
            raise RuntimeError("npm is not installed: it brings the Gateway API schemas") from exc
        if done.returncode != 0:
            raise RuntimeError(f"npm install {NPM_PACKAGE}@{NPM_VERSION} failed with exit code "
                               f"{done.returncode}:\n{done.stderr.strip()}")
        os.replace(Path(tmp) / "node_modules", folder / "node_modules")  # whole or absent
