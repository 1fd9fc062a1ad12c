"""A model named by its hub id (owner/name): asked of the hub once, briefly, else found in the
hub cache.

transformers asks the hub for every file it loads and, when no network answers, retries each
request for about 25 s before it looks in the cache: a server started with a hub id on a machine
without network waited 51 s for a traceback. sled asks first, once, with a short timeout and no
retries:

    the hub answers             the id as given (transformers fetches what the cache lacks); a
                                model the hub does not have, or gates, is one line
    no answer, or offline       the cached snapshot's folder, and nothing more is asked of the
    (HF_HUB_OFFLINE=1)          hub; not cached: one line that says how to get the weights here

Only the server's side imports this (verify_server.target): huggingface_hub comes with
transformers, in the server extra.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from huggingface_hub import HfApi, constants, try_to_load_from_cache
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError,
                                    RepositoryNotFoundError)
from huggingface_hub.utils import validate_repo_id

from sled.models import checkpoint_problem

log = logging.getLogger("sled.hub")

ANSWER_TIMEOUT_S = 5.0    # the hub's first answer; no network at all fails at once


def is_hub_id(spec: str) -> bool:
    """Whether SPEC is spelled as a hub repository id (name or owner/name)."""
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def hub_model(repo_id: str) -> str:
    """What transformers should load for REPO_ID: the id itself when the hub answers, else its
    cached snapshot's folder. ValueError (one line: what to do) for a model the hub does not
    have or gates, and for one neither the hub nor the cache can give."""
    if constants.is_offline_mode():
        return cached_snapshot(repo_id, "HF_HUB_OFFLINE is set")
    silence = hub_silence(repo_id)
    if silence is None:
        return repo_id
    folder = cached_snapshot(repo_id, f"the hub did not answer ({silence})")
    work_offline()
    log.warning("the hub did not answer (%s): %s loads from its cached snapshot, and this "
                "process asks nothing more of the hub (HF_HUB_OFFLINE=1)", silence, repo_id)
    return folder


def work_offline() -> None:
    """From here on this process, and every process it starts (a split server's ranks), goes
    to the hub cache at once: no request waits on a hub that did not answer."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def hub_silence(repo_id: str) -> str | None:
    """None when the hub answers for REPO_ID (one request, a second for a gated model; no
    retries); why it did not, in a phrase, when it did not. ValueError for a model it does not
    have, or gates from this caller."""
    api = HfApi()
    try:
        info = api.model_info(repo_id, timeout=ANSWER_TIMEOUT_S)
        if info.gated:
            api.auth_check(repo_id)
    except GatedRepoError:
        raise ValueError(f"{repo_id} is gated on the hub: accept its terms on its page there, "
                         "then log in (hf auth login) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(f"the hub has no model {repo_id} (or a private one: log in with hf auth "
                         "login or set HF_TOKEN): check the id, or give a local folder, a "
                         "built-in alias or synthetic:NAME") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        return f"it answered {status}"
    except Exception as exc:    # nothing answered: no route, no name, refused, timed out, a proxy
        return f"{type(exc).__name__}: {exc}".strip().rstrip(":")
    return None


def cached_snapshot(repo_id: str, why: str) -> str:
    """REPO_ID's snapshot folder in the hub cache (its main revision) when it holds a whole
    checkpoint; else ValueError: `why` the hub was not asked or did not answer, and how to get
    the weights here."""
    cache = constants.HF_HUB_CACHE
    config = try_to_load_from_cache(repo_id, "config.json")
    problem = "is not in the hub cache"
    if isinstance(config, str):
        folder = Path(config).parent
        found = checkpoint_problem(folder)
        if found is None:
            return str(folder)
        problem = f"is only partly in the hub cache ({found})"
    raise ValueError(f"{repo_id} {problem} ({cache}) and {why}: give --model a local folder of "
                     f"its safetensors, or run `hf download {repo_id}` on a machine with network, "
                     f"copy its cache to {cache} here and start with HF_HUB_OFFLINE=1")
