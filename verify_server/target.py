"""The target model p: a transformers causal LM with its tokenizer, and what the wire says of it.

The target is the one owner of what the server serves: its context length (after any cap) and
its SATs. The engine is handed the SATs when it is built; everything else asks the target."""
from __future__ import annotations

import functools
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

try:       # where transformers takes its tensor-parallel plan in a config (5.x, later releases)
    from transformers.distributed import DistributedConfig
except ImportError:
    DistributedConfig = None

from sled.cache import MAX_TOKENIZER_CHUNK_BYTES
from sled.chat_templates import with_chat_template
from sled.hub import hub_model, is_hub_id
from sled.models import BUILTIN, builtin_sat_adapter, checkpoint_problem, resolve_model
from sled.progress import phase
from sled.v1 import verifier_pb2 as pb
from sled.wire.fingerprint import files_fingerprint, fingerprint_tokenizer
from verify_server.sdsat import SatSpec, sat_spec_of
from verify_server.synthetic import is_synthetic, shape_of, synthetic_model

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


@dataclass(slots=True)
class Target:
    model: torch.nn.Module
    tokenizer: object
    model_id: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    context_length: int            # tokens of context served (the model's limit, or a lower cap)
    fingerprint: str
    sat: SatSpec | None = None     # semantic adaptive tokens, when the target has them
    tokenizer_reply: tuple[bytes, ...] = ()   # the GetTokenizer stream: its chunks, encoded once

    @classmethod
    def load(cls, model_id: str, dtype: str = "float32", device: str = "cpu",
             trust_remote_code: bool = False, name: str | None = None,
             sat_adapter: str | None = None, sat: bool = True, tp: int = 1) -> "Target":
        """Load an AutoModelForCausalLM from safetensors (a local path or a hub id); `name` is
        what devices are told the model is called, as given (default: model_id, but of a path
        only its folder's name). SATs come from
        `sat_adapter`, an adapter file beside the model, or the model's config; sat=False
        serves the model without them. tp > 1: this process's shard of the model split over tp
        ranks (transformers' tensor-parallel plan; the process group is joined, verify_server.ranks),
        on the device that rank uses."""
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        if tp > 1:
            check_splittable(model_id, tp, trust_remote_code, name)
        if is_synthetic(model_id):
            return cls.synthetic(model_id, dtype, device, name, sat_adapter if sat else None)
        with phase("target.tokenizer", f"loading the tokenizer of {name or public_name(model_id)}"):
            tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=trust_remote_code)
        tokenizer = with_chat_template(tokenizer, model_id)   # a built-in converted without one
        with phase("target.weights", f"loading the weights of {name or public_name(model_id)}"):
            model = AutoModelForCausalLM.from_pretrained(
                model_id, dtype=DTYPES[dtype], use_safetensors=True,
                trust_remote_code=trust_remote_code, **split_plan(tp)).eval()
            if tp == 1:     # a split model is placed on its rank's device by the plan
                model = model.to(device)
        local = Path(model_id) if Path(model_id).is_dir() else None
        spec = sat_spec_of(model, local, sat_adapter) if sat else None
        if tp > 1 and spec is not None and spec.lora is not None:
            raise ValueError(f"the SAT adapter {spec.source} carries LoRA deltas, which sled "
                             "does not apply to a model split over ranks: serve it with --tp 1, "
                             "or with --no-sat")
        return cls._of(model, tokenizer, model_id, spec, name)

    @classmethod
    def synthetic(cls, model_id: str, dtype: str = "bfloat16", device: str = "cpu",
                  name: str | None = None, sat_adapter: str | None = None) -> "Target":
        """synthetic:NAME (verify_server.synthetic): a Gemma 3 shape with random weights; SATs
        only from `sat_adapter`, a file of its shape (`sled bench sdsat --sat-adapter random`
        writes one)."""
        shape_of(model_id)      # an unknown name is said before anything is made
        with phase("target.weights", f"making random {dtype} weights for {model_id}"):
            model, tokenizer = synthetic_model(model_id, DTYPES[dtype], device)
        spec = sat_spec_of(model, None, sat_adapter) if sat_adapter else None
        return cls._of(model, tokenizer, model_id, spec, name)

    @classmethod
    def from_model(cls, model, tokenizer, model_id: str, sat: SatSpec | None = None) -> "Target":
        """A loaded model as a target; its SATs are `sat`, else the token ids its config names."""
        return cls._of(model, tokenizer, model_id, sat if sat is not None else sat_spec_of(model))

    @classmethod
    def _of(cls, model, tokenizer, model_id: str, sat: SatSpec | None,
            name: str | None = None) -> "Target":
        """`name` (an operator's choice) is kept as given; else model_id, path-free."""
        config = model.config.get_text_config(decoder=True)
        fingerprint = fingerprint_tokenizer(tokenizer)
        return cls(
            model=model,
            tokenizer=tokenizer,
            model_id=name or public_name(model_id, model.config),
            vocab_size=int(config.vocab_size),
            eos_ids=eos_ids_of(model),
            context_length=getattr(config, "max_position_embeddings", None) or 2048,
            fingerprint=fingerprint,
            sat=sat,
            tokenizer_reply=tokenizer_reply(tokenizer, fingerprint),
        )

    @property
    def tokenizer_files_sha256(self) -> str:
        """What the GetTokenizer stream's files are (sled.wire.fingerprint.files_fingerprint)."""
        return files_sha256_of(self.tokenizer_reply)

    def cap_context(self, limit: int | None) -> None:
        """Serve at most `limit` tokens of context (never more than the model's own limit)."""
        if limit is not None:
            self.context_length = min(self.context_length, limit)

    @property
    def sat_slots(self) -> int:
        """SAT slots a forward may append (0: the target has no SATs)."""
        return self.sat.slots if self.sat is not None else 0

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def device(self) -> str:
        return str(next(self.model.parameters()).device)

def split_plan(tp: int) -> dict:
    """from_pretrained's arguments for this rank's shard of a model split over tp ranks:
    transformers' own tensor-parallel plan (a DistributedConfig where this transformers takes
    one, else the older tp_plan argument)."""
    if tp == 1:
        return {}
    try:
        return {"distributed_config": DistributedConfig(tp_plan="auto")}
    except TypeError:       # no DistributedConfig, or one without tp_plan
        return {"tp_plan": "auto"}


def check_splittable(model_id: str, tp: int, trust_remote_code: bool = False,
                     name: str | None = None) -> None:
    """ValueError (one line) unless the model splits over `tp` ranks: transformers has a
    tensor-parallel plan for it, and its attention and KV heads divide by tp. Reads the
    config only: sled serve --tp N asks before it starts any rank."""
    name = name or public_name(model_id)
    if is_synthetic(model_id):
        raise ValueError(f"{name} has random weights made in each process, which cannot be split "
                         "over ranks: give --tp 1, or a checkpoint")
    config = AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code)
    text = config.get_text_config(decoder=True)
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(f"{name} ({text.model_type}) has no tensor-parallel plan in "
                         "transformers: serve it with --tp 1")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        fits = [str(n) for n in range(1, kv_heads + 1) if not heads % n and not kv_heads % n]
        choice = f"--tp {', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else "--tp 1"
        raise ValueError(f"{name} has {heads} attention heads and {kv_heads} KV heads, which do "
                         f"not split over --tp {tp}: use {choice}")


def serialize_tokenizer(tokenizer) -> dict[str, bytes]:
    """The files save_pretrained writes, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def tokenizer_reply(tokenizer, fingerprint: str) -> tuple[bytes, ...]:
    """The encoded TokenizerChunks of the GetTokenizer stream: the files a device loads with
    AutoTokenizer.from_pretrained(dir), one after another, each cut into chunks of at most
    MAX_TOKENIZER_CHUNK_BYTES that carry the file's size and sha256 (an empty file: one chunk)."""
    chunks = []
    for name, content in serialize_tokenizer(tokenizer).items():
        digest = hashlib.sha256(content).hexdigest()
        for offset in range(0, max(len(content), 1), MAX_TOKENIZER_CHUNK_BYTES):
            chunk = pb.TokenizerChunk(tokenizer_fingerprint=fingerprint, name=name, offset=offset,
                                      data=content[offset:offset + MAX_TOKENIZER_CHUNK_BYTES],
                                      size=len(content), sha256=digest)
            chunks.append(chunk.SerializeToString())
    return tuple(chunks)


@functools.lru_cache(maxsize=8)
def files_sha256_of(reply: tuple[bytes, ...]) -> str:
    """files_fingerprint of the files in a GetTokenizer reply (each chunk names its file's
    sha256); "" for a target without one."""
    if not reply:
        return ""
    file_sha256 = {}
    for encoded in reply:
        chunk = pb.TokenizerChunk.FromString(encoded)
        file_sha256[chunk.name] = chunk.sha256
    return files_fingerprint(file_sha256)


def public_name(model_id: str, config=None) -> str:
    """What devices are told the model is called: a hub id or an alias as given, but for a
    local path only its last component (the server's file system is nobody's business)."""
    path = Path(model_id).expanduser()
    if not model_id or not _looks_like_path(model_id, path):
        return model_id
    name = path.resolve().name if path.exists() else path.name
    if not name and config is not None:
        name = Path(str(getattr(config, "name_or_path", "") or "")).name
    return name or "model"


def _looks_like_path(model_id: str, path: Path) -> bool:
    """A folder or file here, or spelled like one (absolute, ~, ./, ../, a backslash)."""
    if model_id.startswith(("/", "~", "./", "../", ".\\")) or "\\" in model_id:
        return True
    try:
        return path.exists()
    except OSError:
        return False


def eos_ids_of(model) -> tuple[int, ...]:
    """EOS ids as generate() uses them: the generation config first, then the model config."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return tuple(sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}))
    return ()


def locate_target(spec: str) -> str:
    """What Target.load should load for SPEC: a built-in alias's converted checkpoint, a local
    folder that holds a whole safetensors checkpoint, or a hub id as sled.hub finds it (on the
    hub, else in its cache); synthetic:NAME as given. ValueError (one line: what to give
    instead) for anything else, before torch loads a byte of it."""
    if is_synthetic(spec) or spec in BUILTIN:
        return resolve_model(spec)
    path = Path(spec).expanduser()
    if _looks_like_path(spec, path):
        if not path.is_dir():
            raise ValueError(f"{spec} is not a folder here: give --model the folder of a "
                             "transformers checkpoint (config.json, *.safetensors), a hub id "
                             f"(owner/name), a built-in alias ({', '.join(BUILTIN)}) or "
                             "synthetic:NAME")
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"{spec} is not a whole safetensors checkpoint ({problem}): give the "
                             "folder save_pretrained(..., safe_serialization=True) wrote")
        return str(path)
    if not is_hub_id(spec):
        raise ValueError(f"{spec!r} is neither a folder here nor a hub id (owner/name): give "
                         f"one, a built-in alias ({', '.join(BUILTIN)}) or synthetic:NAME")
    return hub_model(spec)


def load_target(settings, located: str | None = None):
    """The target the settings name, with its SATs (the built-in adapter for a built-in alias);
    `located`: the model as locate_target found it, when the caller has asked already."""

    adapter = settings.sat_adapter
    if adapter is None and settings.sat:
        adapter = builtin_sat_adapter(settings.model)
    return Target.load(located or locate_target(settings.model), dtype=settings.dtype,
                       device=settings.device, trust_remote_code=settings.trust_remote_code,
                       name=settings.model, sat_adapter=adapter, sat=settings.sat, tp=settings.tp)
