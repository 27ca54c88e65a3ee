"""An OCI image (image layout, as one tar) from files of this machine, for release/dry-run.sh: no daemon, no base
image, no registry. Each ELF file brings the shared libraries `ldd` names, at the paths ldd gives.

    python3 release/oci_image.py OUT.tar REF ENTRYPOINT CMD USER SRC=DEST...
    python3 release/oci_image.py --unpack OUT.tar DIR      # the image's one layer into DIR (its root file system)

The bytes depend only on the files and SOURCE_DATE_EPOCH (default 0): names sorted, owner 0:0, mode 0755 for
executables and directories (0644 otherwise), every time that epoch.
"""

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time

EPOCH = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))


def libraries(path):
    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF":
            return []
    out = subprocess.run(["ldd", path], capture_output=True, text=True, check=False).stdout
    return sorted(set(re.findall(r"(/\S+)", out)))


def layer(specs):
    files = {}
    for spec in specs:
        src, dest = spec.split("=", 1)
        files[dest.lstrip("/")] = src
        for lib in libraries(src):
            files.setdefault(lib.lstrip("/"), lib)
    dirs = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for dest in sorted(files):
            data = open(os.path.realpath(files[dest]), "rb").read()
            info = tarfile.TarInfo(dest)
            info.size, info.mtime = len(data), EPOCH
            info.mode = 0o755 if os.access(files[dest], os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def blob(blobs, data):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return digest


def build(out, ref, entry, cmd, user, specs):
    blobs = {}
    data = layer(specs)
    layer_digest = blob(blobs, data)
    version = ref.rsplit(":", 1)[1]
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(EPOCH)),
        "config": {
            "Entrypoint": [entry],
            "Cmd": [cmd],
            "User": user,
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
            "Labels": {"org.opencontainers.image.version": version, "org.opencontainers.image.licenses": "Apache-2.0"},
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    config_digest = blob(blobs, config_bytes)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(data)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest_digest = blob(blobs, manifest_bytes)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"org.opencontainers.image.ref.name": ref},
            }
        ],
    }
    entries = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": json.dumps(index, sort_keys=True).encode()}
    for digest, data in blobs.items():
        entries["blobs/sha256/" + digest.split(":")[1]] = data
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for name in sorted(entries):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(entries[name]), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(entries[name]))


def unpack(path, directory):
    with tarfile.open(path) as tar:
        read = lambda name: tar.extractfile(name).read()  # noqa: E731
        index = json.loads(read("index.json"))
        manifest = json.loads(read("blobs/sha256/" + index["manifests"][0]["digest"].split(":")[1]))
        (layer_desc,) = manifest["layers"]
        data = read("blobs/sha256/" + layer_desc["digest"].split(":")[1])
    with tarfile.open(fileobj=io.BytesIO(data)) as rootfs:
        rootfs.extractall(directory, filter="tar")


def main():
    if sys.argv[1] == "--unpack":
        unpack(sys.argv[2], sys.argv[3])
    else:
        out, ref, entry, cmd, user, *specs = sys.argv[1:]
        build(out, ref, entry, cmd, user, specs)


if __name__ == "__main__":
    main()
