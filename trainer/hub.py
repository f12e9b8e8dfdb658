"""``specray push``: an export (ours or a peer format's) to a Hugging Face Hub model repo, verified.

    specray push runs/x/exports/step-00000120-sglang --repo me/qwen3-8b-dflash [--revision v1] [--private]

1. The export is checked before anything is sent: our format (``read_drafter_config``, the
   weights' sha256 against export.json) or a peer format's (``specray_export.json``: the weights'
   sha256 it recorded). Its model card is rendered again from its provenance (``README.md``,
   ``drafters/card.py``): the repo page states the target, contract, data and acceptance.
2. The manifest: every file of the directory (regular files, no sub-directories or links) with
   its size and sha256.
3. ``huggingface_hub``: ``create_repo`` (kept if it exists), ``create_branch`` for a revision
   other than main, one ``create_commit`` that adds every file and deletes the remote files the
   export does not have (the revision then holds exactly the export and ``.gitattributes``).
4. Verification: ``list_repo_files`` of the revision must be the manifest's names, and
   ``get_paths_info`` must give each file the local size and content hash: the sha256 of an LFS
   file, the git blob id (sha1 of ``blob <size>\\0`` + content) of any other. A difference raises
   ``PushVerificationError`` naming the files.

The endpoint is ``endpoint`` / ``$HF_ENDPOINT`` (read when the push runs; default the Hub), the
token ``token`` / ``$HF_TOKEN`` / the saved login. A server without Xet storage (a local one, as in
tests/trainer/hub_server.py) needs ``HF_HUB_DISABLE_XET=1``: huggingface_hub uploads large files
through Xet whenever ``hf_xet`` is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from specray.drafters.card import CARD_FILE, PEER_RECORD, render_card
from specray.drafters.format import _sha256, read_drafter_config

GITATTRIBUTES = ".gitattributes"  # the Hub's own file in every repo


class PushVerificationError(RuntimeError):
    """The repo revision does not hold what was uploaded."""


@dataclass
class PushResult:
    repo_id: str
    revision: str
    commit: str  # the commit's id
    url: str  # the commit's URL
    files: dict[str, dict] = field(default_factory=dict)  # name -> {"size", "sha256"}: what was verified


def _git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def check_export(export_dir: Path) -> str:
    """Refuse a directory that is not an intact export; returns its kind ("specray" or the peer format)."""
    if not export_dir.is_dir():
        raise FileNotFoundError(f"{export_dir} is not a directory; push an export (specray export)")
    bad = [p.name for p in export_dir.iterdir() if p.is_symlink() or not p.is_file()]
    if bad:
        raise ValueError(f"{export_dir} holds {bad}: an export directory holds regular files only")
    record = export_dir / PEER_RECORD
    if record.is_file():
        recorded = json.loads(record.read_text()).get("weights_sha256")
        kind = json.loads(record.read_text()).get("format_name", "peer")
    else:
        read_drafter_config(export_dir)
        recorded = json.loads((export_dir / "export.json").read_text()).get("weights_sha256")
        kind = "specray"
    if _sha256(export_dir / "model.safetensors") != recorded:
        raise ValueError(f"{export_dir}/model.safetensors does not match the sha256 its provenance records "
                         "(corrupt copy?); re-export it")
    return kind


def export_manifest(export_dir: Path, card: bytes) -> dict[str, bytes | Path]:
    """The files to upload: the directory's, with the model card rendered now."""
    files: dict[str, bytes | Path] = {p.name: p for p in sorted(export_dir.iterdir()) if p.name != CARD_FILE}
    files[CARD_FILE] = card
    return files


def _digest(source: bytes | Path) -> tuple[int, str, str]:
    """(size, sha256, git blob id) of a file or bytes."""
    data = source if isinstance(source, bytes) else source.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest(), _git_blob_id(data)


def verify_remote(api, repo_id: str, revision: str, files: dict[str, bytes | Path]) -> dict[str, dict]:
    """``PushVerificationError`` unless the revision holds exactly ``files``, each with its size and hash."""
    remote = set(api.list_repo_files(repo_id, revision=revision, repo_type="model")) - {GITATTRIBUTES}
    if remote != set(files):
        raise PushVerificationError(f"{repo_id}@{revision} holds {sorted(remote)}, the export {sorted(files)}: "
                                    f"missing {sorted(set(files) - remote)}, extra {sorted(remote - set(files))}")
    info = {f.path: f for f in api.get_paths_info(repo_id, sorted(files), revision=revision, expand=True)}
    verified, wrong = {}, []
    for name, source in files.items():
        size, sha256, blob = _digest(source)
        entry = info.get(name)
        same = entry is not None and entry.size == size and (
            entry.lfs.sha256 == sha256 if entry.lfs is not None else entry.blob_id == blob)
        if not same:
            wrong.append(name)
        verified[name] = {"size": size, "sha256": "sha256:" + sha256}
    if wrong:
        raise PushVerificationError(f"{repo_id}@{revision}: {wrong} differ from the export after the upload (size "
                                    "or content hash); the push is not complete, run it again")
    return verified


def push_export(export_dir: str | Path, repo_id: str, *, revision: str | None = None, private: bool = False,
                token: str | None = None, endpoint: str | None = None,
                commit_message: str | None = None) -> PushResult:
    """Upload the export in ``export_dir`` to the model repo ``repo_id`` and verify it (module doc)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    path = Path(export_dir)
    kind = check_export(path)
    card = render_card(path).encode()
    files = export_manifest(path, card)
    revision = revision or "main"
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if revision != "main":
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    stale = set(api.list_repo_files(repo_id, revision=revision, repo_type="model")) - set(files) - {GITATTRIBUTES}
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=source if isinstance(source, bytes)
                                     else str(source)) for name, source in files.items()]
    operations += [CommitOperationDelete(path_in_repo=name) for name in sorted(stale)]
    commit = api.create_commit(repo_id, operations, repo_type="model", revision=revision,
                               commit_message=commit_message or f"specray push: {kind} export {path.name}")
    verified = verify_remote(api, repo_id, revision, files)
    return PushResult(repo_id, revision, commit.oid, commit.commit_url, verified)
