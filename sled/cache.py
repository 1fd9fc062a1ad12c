"""Where sled keeps what it converts, exports or fetches once: $SLED_CACHE (~/.cache/sled).

Every cached folder is trusted only through its manifest, never through a marker file: the
manifest (MANIFEST, written last, atomically) lists each file (by its path inside the folder,
subfolders included) with its size, mtime and sha256.
verify_folder() checks that the folder holds exactly those files at those sizes; a file whose
mtime still matches is taken as written (so a 500 MB checkpoint costs a few stat calls per start,
not a 1 s hash), and one whose mtime moved (a copy, a touch, an edit in place) is hashed and must
match. full=True hashes every file (the tokenizer, small and read whole anyway, always is).
Whatever does not verify is rebuilt, or fetched again, by its owner. Why not hash always: a
converted gemma3 checkpoint is 1 GB, about a second of hashing per start for damage that size and
mtime already reveal (a truncated, deleted, rewritten or copied file); what they miss is only a
same-size edit that also puts the old mtime back, which no accident does. A single file whose
content is known (the assembled GGUF) is checked the same way against a stamp (verified_file).
A manifest may also record the tokenizer fingerprint its files were checked against (written
only after that check): a folder that verifies in full then needs no fingerprinting again.

Nothing a peer sends becomes a path here: a tokenizer's folder is named by the sha256 of the
fingerprint string the server sent (tokenizer_dir), and only TOKENIZER_FILES are written into it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MANIFEST = ".manifest.json"
# The file names a verify server's GetTokenizer may send (what transformers' save_pretrained
# writes for a tokenizer); a device refuses any other name.
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt",
})
MAX_TOKENIZER_BYTES = 48 << 20      # all tokenizer files together (gemma3's tokenizer.json: 33 MB)
MAX_TOKENIZER_CHUNK_BYTES = 1 << 20  # data in one GetTokenizer chunk: far below gRPC's default 4 MiB
MAX_FINGERPRINT_CHARS = 256         # "sha256:" + 64 hex digits is what sled servers send


class CacheError(Exception):
    """A cache entry cannot be made or used; the message is one line for the person."""


def cache_dir() -> Path:
    return Path(os.environ.get("SLED_CACHE", Path.home() / ".cache" / "sled"))


def tokenizer_dir(fingerprint: str, files_sha256: str) -> Path:
    """The on-disk copy of the tokenizer with this fingerprint made of these very files
    (sled.wire.fingerprint.files_fingerprint): two servers with one vocabulary and other files never
    share a copy. Named by a hash of both (they come from a server and never become a path)."""
    key = hashlib.sha256(f"{fingerprint}\n{files_sha256}".encode("utf-8", "surrogatepass")).hexdigest()
    return cache_dir() / "tokenizers" / key


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _entry(path: Path, sha256: str | None = None) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": sha256 or file_sha256(path)}


def write_manifest(folder: Path, fingerprint: str | None = None) -> None:
    """Record every file of the folder (subfolders included, by relative path) in its manifest:
    the last write of a cache entry, after which verify_folder() accepts it. FINGERPRINT: the
    tokenizer fingerprint these files were checked against (pass it only after that check)."""
    entries = {name: _entry(folder / name) for name in sorted(_files(folder))}
    _write_manifest(folder, entries, fingerprint)


def _write_manifest(folder: Path, entries: dict[str, dict], fingerprint: str | None) -> None:
    manifest = {"files": entries} | ({"fingerprint": fingerprint} if fingerprint else {})
    write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1).encode())


def manifest_fingerprint(folder: Path) -> str | None:
    """The tokenizer fingerprint the folder's files were checked against, when its manifest
    records one (trust it only together with verify_folder(folder, full=True))."""
    try:
        fingerprint = json.loads((folder / MANIFEST).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None
    return fingerprint if isinstance(fingerprint, str) and fingerprint else None


def record_fingerprint(folder: Path, files: dict[str, dict], fingerprint: str) -> None:
    """Add FINGERPRINT to a manifest whose FILES (read_manifest) were verified in full and
    loaded into a tokenizer that matched it: the entries are those checked, not hashed again."""
    _write_manifest(folder, files, fingerprint)


def _files(folder: Path) -> set[str]:
    """The relative paths (with /) of every file under FOLDER, its manifest and the manifest's
    temporary copies left out."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.is_file() and not (p.parent == folder and p.name.startswith(MANIFEST))}


def write_atomically(path: Path, data: bytes) -> None:
    """PATH holds DATA, all of it or (to a concurrent reader, or after a crash) its old content:
    written to a temporary file beside it (mode 0600) and renamed over it."""
    fd, partial = tempfile.mkstemp(prefix=path.name, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def read_manifest(folder: Path) -> dict[str, dict] | None:
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        return {str(name): {"size": int(e["size"]), "mtime_ns": int(e["mtime_ns"]),
                            "sha256": str(e["sha256"])} for name, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def verify_folder(folder: Path, full: bool = False) -> bool:
    """The folder holds exactly the files of its manifest, each whole (see the module docstring).
    Files found whole after hashing get their new mtime recorded, so the next check is cheap."""
    manifest = read_manifest(folder)
    if not manifest:
        return False
    try:
        if _files(folder) != set(manifest):
            return False
        seen = {}                   # the entries as found now: new mtimes, checked content
        for name, want in manifest.items():
            stat = (folder / name).stat()
            if stat.st_size != want["size"]:
                return False
            if full or stat.st_mtime_ns != want["mtime_ns"]:
                if file_sha256(folder / name) != want["sha256"]:
                    return False
            seen[name] = want | {"mtime_ns": stat.st_mtime_ns}
        if seen != manifest:        # what was hashed is recorded, not hashed again
            _write_manifest(folder, seen, manifest_fingerprint(folder))
    except OSError:
        return False
    return True


def publish(partial: Path, folder: Path) -> None:
    """Move a finished entry (a folder built beside its place, manifest included) into place,
    replacing whatever was there; a concurrent writer of the same entry may win, then its copy
    stays. The caller, which made PARTIAL, removes what is left of it (its `finally`)."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        partial.rename(folder)
    except OSError:
        if not verify_folder(folder):
            raise


def adopt(folder: Path, is_whole: Callable[[Path], bool]) -> bool:
    """A cache entry from before manifests: given its manifest when IS_WHOLE finds it structurally
    whole (a folder that has a manifest already is not adopted: it verifies or is rebuilt)."""
    if read_manifest(folder) is not None or not is_whole(folder):
        return False
    write_manifest(folder)
    return True


def partial_dir(folder: Path) -> Path:
    """A fresh, empty folder beside FOLDER (same file system, so publish() is a rename)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.sha256.json")


def verified_file(path: Path, sha256: str) -> bool:
    """PATH holds the content with this sha256: taken from its stamp while size and mtime match
    it, else hashed (and stamped again when it matches)."""
    try:
        stat = path.stat()
        stamp = json.loads(_stamp_path(path).read_text())
        if (stamp["size"], stamp["mtime_ns"], stamp["sha256"]) == (stat.st_size, stat.st_mtime_ns, sha256):
            return True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        if file_sha256(path) != sha256:
            return False
    except OSError:
        return False
    stamp_file(path, sha256)
    return True


def stamp_file(path: Path, sha256: str) -> None:
    """Record that PATH, as it is now, has this sha256 (see verified_file)."""
    write_atomically(_stamp_path(path), json.dumps(_entry(path, sha256)).encode())
