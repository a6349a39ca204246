"""The tiny Llama-architecture base model every notebook starts from, and ``load_model``.

The model is built from a ``LlamaConfig``, its tokenizer is trained with ``tokenizers`` on
``data/``, and it is pretrained briefly on the base corpus so that it is a real base model whose
eval loss has dropped far below chance. Both are saved with ``save_pretrained`` and read back with
``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``: exactly the path a hub model takes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import socket
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from recipes_lib import data
from recipes_lib.architectures import quiet_transformers, transformers_progress_bars
from recipes_lib.memory import tensor_bytes

DEFAULT_CACHE = Path(os.environ.get("RECIPES_CACHE", Path(__file__).resolve().parent.parent
                                    / ".cache"))
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny base model and its pretraining run (the defaults are the CI size).

    Dimensions are multiples of 64 so that NF4's 64-value blocks tile every weight exactly.

    Attributes:
        vocab_size: tokens in the trained BPE vocabulary.
        hidden_size: width of the residual stream.
        intermediate_size: width of the MLP.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention).
        max_position_embeddings: the positions the model is built for.
        pretrain_steps: optimizer steps of the pretraining run.
        pretrain_batch_size: sequences per pretraining step.
        pretrain_seq_len: tokens per pretraining sequence.
        pretrain_lr: its peak learning rate.
        seed: initialisation and data-order seed.
        architecture: "llama", another decoder of ``ARCHITECTURES`` (qwen2, qwen3, mistral,
            phi3, gemma2), or "gpt_neox" (LayerNorm instead of RMSNorm, notebook 03).
        eval_sequences: the held-out sequences the report's eval losses (before and after
            pretraining) are measured on; 0: all of them (200 at the default length).

    Raises:
        ValueError: naming the field, for a size that is not a positive integer, a learning
            rate <= 0, or head counts that do not divide the width and each other.

    Example:
        >>> TinyModelSpec.smallest("qwen2").num_hidden_layers
        2
    """

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    pretrain_steps: int = 150
    pretrain_batch_size: int = 16
    pretrain_seq_len: int = 128
    pretrain_lr: float = 3e-3
    seed: int = 0
    # "llama", another decoder of ARCHITECTURES (qwen2, qwen3, mistral, phi3, gemma2), or
    # "gpt_neox": LayerNorm instead of RMSNorm (notebook 03)
    architecture: str = "llama"
    eval_sequences: int = 0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name in ("architecture", "pretrain_lr"):
                continue
            least = int(name not in ("seed", "eval_sequences"))
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name}={value!r}: must be an integer >= {least}")
        if not self.pretrain_lr > 0:
            raise ValueError(f"pretrain_lr={self.pretrain_lr!r}: must be > 0")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads}: must divide "
                             f"hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads}: must divide "
                             f"num_attention_heads={self.num_attention_heads}")

    @classmethod
    def smallest(cls, architecture: str = "llama") -> TinyModelSpec:
        """The unit tests' size: the default width (so NF4's blocks still tile every weight) with
        2 layers, pretrained for 5 steps (the tests check equivalences and bytes, not what the
        model learned; each step costs ~0.15 s here), its report's losses on 32 held-out
        sequences (the whole split's two evaluations took half of a 4.4 s build); each
        architecture's recipes run on it in seconds."""
        return cls(intermediate_size=512, num_hidden_layers=2, pretrain_steps=5,
                   architecture=architecture, eval_sequences=32)

    def cache_name(self) -> str:
        fields = asdict(self)
        if not fields["eval_sequences"]:  # the folders built before the field existed
            del fields["eval_sequences"]
        digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        arch = self.architecture.replace("_", "")
        return f"tiny-{arch}-{self.hidden_size}h{self.num_hidden_layers}l-{digest[:8]}"


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer.

    Args:
        texts: the training texts.
        vocab_size: tokens in the vocabulary (at least 260: the bytes and special tokens).
        max_length: the tokenizer's ``model_max_length``.

    Returns:
        The ``PreTrainedTokenizerFast``, with bos, eos and pad tokens.

    Raises:
        ValueError: for a ``vocab_size`` below 260.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise ValueError(f"vocab_size={vocab_size}: byte-level BPE needs at least 260")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=max_length, padding_side="right", **SPECIAL_TOKENS
    )


# What each architecture changes beside Llama, at the tiny size (from its transformers config):
# Qwen2 and Qwen3 tie the head to the embeddings as their small checkpoints do (Qwen3 adds q/k
# RMSNorm and, as its checkpoints do, heads twice hidden / heads wide: Qwen3-0.6B has 16 heads of
# 128 on a 1024-wide stream, so q_proj widens and o_proj narrows), Mistral is Llama with a
# sliding window option, Phi-3 fuses qkv_proj and gate_up_proj, Gemma-2 ties, soft-caps
# attention and final logits, and alternates sliding (half the context, as Gemma-2's 4096 of
# 8192) and global layers.
_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": True, "head_dim": "wide"},
    "mistral": {"tie_word_embeddings": False, "sliding_window": None, "head_dim": "auto"},
    "phi3": {"tie_word_embeddings": False, "original_max_position_embeddings": "positions"},
    "gemma2": {"tie_word_embeddings": True, "head_dim": "auto", "query_pre_attn_scalar": "auto",
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "sliding_window": "half"},
}
ARCHITECTURES = (*_EXTRA, "gpt_neox")


def model_config(spec: TinyModelSpec, tokenizer) -> Any:
    """The transformers config of ``spec.architecture`` for ``spec`` with ``tokenizer``'s special
    ids (``LlamaConfig`` by default; see ``ARCHITECTURES``).

    Args:
        spec: the sizes.
        tokenizer: gives the special token ids.

    Returns:
        The config.
    """
    from transformers import AutoConfig, GPTNeoXConfig

    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    if spec.architecture == "gpt_neox":
        return GPTNeoXConfig(
            vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            max_position_embeddings=spec.max_position_embeddings, rotary_pct=1.0,
            tie_word_embeddings=False, **special)
    head_dim = spec.hidden_size // spec.num_attention_heads
    resolve = {"auto": head_dim, "wide": 2 * head_dim, "positions": spec.max_position_embeddings,
               "half": spec.max_position_embeddings // 2}
    extra = {k: resolve.get(v, v) if isinstance(v, str) else v
             for k, v in _EXTRA[spec.architecture].items()}
    return AutoConfig.for_model(
        spec.architecture,
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        **special, **extra,
    )


def build_tiny_model(
    out_dir: Path | str | None = None,
    spec: TinyModelSpec = TinyModelSpec(),
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> Path:
    """Build, pretrain and save the tiny base model; return its folder (cached by ``spec``).

    A second call with the same spec returns the cached folder at once; a call from another
    process while the build runs waits for it (a lock file beside the folder). The build writes
    into a temporary folder and renames it, so an interrupted build is never mistaken for a
    finished one.

    Args:
        out_dir: target folder; default ``.cache/<name>`` in the repository (or $RECIPES_CACHE).
        spec: model sizes and pretraining budget.
        progress: show a progress bar while pretraining.
        device: where to pretrain (the GPU scale's 0.4 B model needs an accelerator; the saved
            folder is the same wherever it was built, up to rounding).

    Returns:
        Path to a folder loadable with ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        ValueError: for an architecture the course cannot build.

    Example:
        >>> path = build_tiny_model()  # doctest: +SKIP
        >>> model, tok = load_model(path), load_tokenizer(path)  # doctest: +SKIP
    """
    if spec.architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={spec.architecture!r}: expected one of {ARCHITECTURES}")
    out = Path(out_dir) if out_dir is not None else DEFAULT_CACHE / spec.cache_name()
    if (out / "pretrain_report.json").exists():
        return out
    with _one_build_at_a_time(out):
        if (out / "pretrain_report.json").exists():  # built while this process waited
            return out
        return _build(out, spec, progress, device)


@contextlib.contextmanager
def _one_build_at_a_time(out: Path) -> Iterator[None]:
    """Two processes that need the same model (two notebooks, parallel test workers): the second
    waits for the first's build instead of building it again beside it. The lock's holder
    removes the partial folders of builds that were killed (builds run under the lock, so no
    other one is live)."""
    try:
        import fcntl
    except ImportError:  # Windows: each process builds into its own partial folder, see _build
        yield
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(f"{out.name}.lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process to finish building {out.name} ...", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in out.parent.glob(f"{out.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(out: Path, spec: TinyModelSpec, progress: bool, device: str | torch.device) -> Path:
    from transformers import AutoModelForCausalLM

    from recipes_lib.evaluation import eval_loss
    from recipes_lib.train import TrainConfig, train

    # one partial folder per process: two processes building the same model (two notebooks, or
    # parallel test workers) never write into each other's
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    base_train = data.load_corpus("base", "train")
    tokenizer = train_tokenizer(list(base_train["text"]), spec.vocab_size,
                                spec.max_position_embeddings)
    # train and pretrain with the tokenizer AutoTokenizer will give back for this folder: for
    # some model types transformers swaps in its own class (Qwen2: Qwen2Tokenizer, which adds a
    # token and splits text its own way), so the saved tokenizer is read back first
    model_config(spec, tokenizer).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tokenizer = load_tokenizer(tmp)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(model_config(spec, tokenizer)).to(device)
    examples = data.tokenize_examples(base_train, tokenizer, spec.pretrain_seq_len, "lm")
    test = data.tokenize_examples(data.load_corpus("base", "test"), tokenizer,
                                  spec.pretrain_seq_len, "lm")[:spec.eval_sequences or None]
    loss_before = eval_loss(model, test, tokenizer.pad_token_id)
    cfg = TrainConfig(steps=spec.pretrain_steps, micro_batch_size=spec.pretrain_batch_size,
                      lr=spec.pretrain_lr, warmup_steps=spec.pretrain_steps // 10,
                      seed=spec.seed, progress=progress, desc="pretraining tiny base model")
    result = train(model, examples, tokenizer.pad_token_id, cfg)
    loss_after = eval_loss(model, test, tokenizer.pad_token_id)

    with transformers_progress_bars(_held_bytes(model)):
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    report = {"spec": asdict(spec), "eval_loss_before": loss_before,
              "eval_loss_after": loss_after, "train_losses": result.losses}
    (tmp / "pretrain_report.json").write_text(json.dumps(report, indent=1))
    if (out / "pretrain_report.json").exists():  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "pretrain_report.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def pretrain_report(path: Path | str) -> dict:
    """The eval losses before/after pretraining recorded by ``build_tiny_model``.

    Args:
        path: the built model's folder.

    Returns:
        The report (``pretrain_report.json``) as a dict.
    """
    return json.loads((Path(path) / "pretrain_report.json").read_text())


def _looks_like_a_path(ident: str) -> bool:
    """A hub id is ``name`` or ``namespace/name``; anything else is meant as a folder."""
    return (Path(ident).is_absolute() or ident.startswith((".", "~")) or ident.count("/") > 1
            or "\\" in ident)


def model_source(model_id_or_path: str | Path) -> str:
    """What to give ``from_pretrained``: the model's folder, or its hub id; offline
    (:func:`hub_offline`), a hub id's folder in the Hugging Face cache, which transformers loads
    without asking the hub for anything.

    Args:
        model_id_or_path: a folder written by ``save_pretrained`` or a hub id.

    Returns:
        The folder or hub id, as a string.

    Raises:
        ValueError: naming ``model_id_or_path`` for a folder that does not exist (transformers
            would take it for a malformed hub id), or a hub id offline that is not cached.

    Example:
        >>> model_source("no/such/folder/")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: model_id_or_path='no/such/folder/': no such folder ...
    """
    ident = str(model_id_or_path)
    if Path(ident).exists():
        return ident
    if isinstance(model_id_or_path, Path) or _looks_like_a_path(ident):
        raise ValueError(f"model_id_or_path={ident!r}: no such folder (a folder written by "
                         "save_pretrained, or a hub id such as 'meta-llama/Llama-3.2-1B')")
    why = hub_offline()
    if why is None:
        return ident
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(ident, "config.json")
    except ValueError:  # not a repository id huggingface_hub accepts
        cached = None
    if isinstance(cached, str):
        return str(Path(cached).parent)
    raise ValueError(
        f"model_id_or_path={ident!r}: not a local folder, not in the Hugging Face cache, and "
        f"{why}; download it first (huggingface-cli download {ident}) or pass a local path")


def hub_offline() -> str | None:
    """Why the Hugging Face hub cannot be asked, or None where it can.

    Offline because HF_HUB_OFFLINE says so, or because the hub's host name does not resolve (no
    network): there huggingface_hub would retry each file five times over ~23 s before falling
    back to its cache, where the name lookup fails in milliseconds. The lookup's answer is kept
    for the process. Behind an HTTPS proxy the proxy resolves the name, not this machine: no
    lookup is made.

    Returns:
        ``"HF_HUB_OFFLINE=1"`` (or ``TRANSFORMERS_OFFLINE``, which huggingface_hub honours too),
        ``"<host> does not resolve (no network)"``, or None.
    """
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # read again: huggingface_hub reads
        if os.environ.get(var, "").upper() in constants.ENV_VARS_TRUE_VALUES:  # them at import
            return f"{var}=1"
    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE=1"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    return None if _resolves(host) else f"{host} does not resolve (no network)"


@functools.cache
def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def hub_config_file(model: str) -> Path | None:
    """A hub model's ``config.json``, from the hub or from the Hugging Face cache
    (``huggingface_hub.hf_hub_download``: it honours HF_HUB_OFFLINE, and without a network it
    falls back to a copy already cached), for the planner and the fake-tensor meter, which need
    a model's config and not its weights.

    Args:
        model: a hub id, ``namespace/name``.

    Returns:
        The file's local path; None where ``model`` is not a hub id of that form (a bare name, a
        path, a ``.json`` file), so that the caller's own error names it.

    Raises:
        ValueError: naming ``model`` where the hub cannot give it (no network and not cached, no
            such repository, a gated one without a token, no config.json there), with the
            reason and what to do offline.

    Example:
        >>> hub_config_file("Llama-3.1-8B") is None and hub_config_file("configs/x.json") is None
        True
    """
    ident = str(model)
    if (ident.count("/") != 1 or _looks_like_a_path(ident) or ident.endswith(".json")
            or Path(ident).exists()):
        return None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    why = hub_offline()
    try:  # offline: the cache alone, at once
        return Path(hf_hub_download(ident, "config.json", local_files_only=why is not None))
    except (OSError, ValueError, EntryNotFoundError) as err:  # offline, not found, gated, bad id
        raise ValueError(
            f"model={ident!r}: no config.json from the hub ({why + ', not cached: ' if why else ''}"
            f"{_first_line(err)}); offline, pass a built-in name or a local config.json "
            f"(huggingface-cli download {ident} config.json, where a network exists, puts it in "
            "the cache this reads)") from err


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"


def load_tokenizer(model_id_or_path: str | Path):
    """``AutoTokenizer.from_pretrained`` with a pad token guaranteed (hub models often lack one).

    Args:
        model_id_or_path: a hub id or a local folder.

    Returns:
        The tokenizer; its pad token is the eos token where it had none.

    Raises:
        ValueError: naming ``model_id_or_path``, as :func:`load_model` does, for a folder that
            does not exist, a hub id while offline, or a tokenizer transformers cannot load.
    """
    from transformers import AutoTokenizer

    ident = model_source(model_id_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(ident, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"model_id_or_path={ident!r}: no tokenizer could be loaded: "
                         f"{_first_line(err)}") from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def scratch_folder(prefix: str = "recipes-") -> Path:
    """A new temporary folder, removed when this process (a notebook's kernel) exits: a notebook's
    checkpoints, exports and adapters (notebook 02 writes ~100 MB a run) do not pile up in the
    temporary directory run after run. A process killed instead of exiting keeps it: nbval kills
    its kernels (``shutdown_kernel(now=True)``), so the test suite gives its processes a
    temporary directory of its own and removes it at the end (conftest.py); JupyterLab's and
    papermill's shutdowns let the kernel exit.

    Args:
        prefix: the folder name's prefix.

    Returns:
        The folder.
    """
    import atexit
    import tempfile

    out = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return out


def save_temporary(model: torch.nn.Module, tokenizer, prefix: str = "model-") -> Path:
    """Save ``model`` and ``tokenizer`` to a new :func:`scratch_folder` (for reloading in another
    dtype, attention implementation or quantization) and return it.

    Args:
        model: a transformers model.
        tokenizer: its tokenizer.
        prefix: the folder name's prefix.

    Returns:
        The folder, loadable with ``from_pretrained`` until this process exits.
    """
    out = scratch_folder(prefix)
    with transformers_progress_bars(_held_bytes(model)):
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _held_bytes(model: torch.nn.Module) -> int:
    return tensor_bytes([*model.parameters(), *model.buffers()])


def _weights_bytes(ident: str) -> int | None:
    """A local checkpoint folder's weight files in bytes; None for a hub id (not known here)."""
    folder = Path(ident)
    if not folder.is_dir():
        return None
    return sum(f.stat().st_size for f in folder.iterdir()
               if f.suffix in (".safetensors", ".bin", ".pt", ".pth"))


def load_model(
    model_id_or_path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    quantization_config: Any = None,
    device: torch.device | str | None = None,
    attn_implementation: str = "auto",
    config: Any = None,
):
    """Load a causal LM from a local folder or a hub id, the same way for both.

    Args:
        model_id_or_path: a folder written by ``save_pretrained`` or a hub id; None builds (or
            reuses) the tiny default model.
        dtype: dtype of the unquantized weights.
        quantization_config: e.g. a ``BitsAndBytesConfig`` for NF4 (see quantization.py).
        device: where to put the model; None keeps CPU (quantized models go where bnb puts them).
        attn_implementation: "auto" (SDPA where transformers has it for the architecture, else
            transformers' own choice, said aloud: Gemma-2 has no SDPA path, for one), "sdpa",
            "eager" or "flash_attention_2" (an explicit choice the architecture lacks is an
            error, with transformers' reason).
        config: the (language model's) config to build it from, e.g. with its positions
            stretched (``max_context.load_with_rope_scaling``); None: the checkpoint's.

    A multimodal checkpoint (Gemma-3 4B and up, Mistral-3) loads as its language model alone,
    said aloud: with the vision tower in, LoRA's "all-linear", FSDP's blocks and checkpointing
    would take the vision encoder's layers too (Gemma-3's first blocks found were SigLIP's).

    Raises:
        ValueError: if a hub id is asked for offline and is not cached, with how to fix it;
            if the model cannot be loaded, with the reason transformers gave; or if a
            multimodal checkpoint's language model is not where its weights were looked for.
    """
    from transformers import AutoModelForCausalLM

    if model_id_or_path is None:
        model_id_or_path = build_tiny_model()
    ident = model_source(model_id_or_path)
    auto = attn_implementation == "auto"
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": False,
                              "attn_implementation": "sdpa" if auto else attn_implementation}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        kwargs["device_map"] = {"": str(device) if device is not None else "cpu"}
    try:
        multimodal = _language_model_only(ident, kwargs)
        if config is not None:
            kwargs["config"] = config
        with (quiet_transformers(bool(multimodal)),  # its table of vision-side weights
              transformers_progress_bars(_weights_bytes(ident))):
            try:
                model, info = AutoModelForCausalLM.from_pretrained(
                    ident, output_loading_info=True, **kwargs)
            except ValueError as err:
                if not (auto and "does not support an attention implementation" in str(err)):
                    raise
                del kwargs["attn_implementation"]  # transformers picks what it has
                model, info = AutoModelForCausalLM.from_pretrained(
                    ident, output_loading_info=True, **kwargs)
                warnings.warn(f"{type(model).__name__} has no SDPA attention in this "
                              f"transformers version: loaded with "
                              f"{model.config._attn_implementation!r} attention (it materialises "
                              "the s x s scores)", stacklevel=2)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"model_id_or_path={ident!r}: could not be loaded: {_first_line(err)} "
            "(a local folder with config.json, or a hub id with network access?)"
        ) from err
    if multimodal:
        missing = [k for k in info["missing_keys"] if not k.startswith("lm_head.")]
        if missing:  # the language model's weights were not where the mapping looked
            raise ValueError(f"model_id_or_path={ident!r}: {multimodal}'s language model did not "
                             f"load: {len(missing)} weights missing ({', '.join(missing[:3])}, "
                             "...)")
        warnings.warn(f"{ident}: a {multimodal} checkpoint: loaded its language model alone "
                      f"({type(model).__name__}, {len(info['unexpected_keys'])} vision-side "
                      "weights left out); the recipes train text", stacklevel=2)
    if device is not None and quantization_config is None:
        model = model.to(device)
    if quantization_config is not None:
        keep_4bit_compute_dtype(model)
    return model


# where a multimodal checkpoint keeps its language model: "language_model.model.*" (Gemma-3's
# and Mistral-3's published files), "model.language_model.*" (transformers' newer layout)
LANGUAGE_MODEL_KEYS = {r"^(?:language_model\.model|model\.language_model)\.": "model.",
                       r"^language_model\.lm_head\.": "lm_head."}


def _language_model_only(ident: str, kwargs: dict[str, Any]) -> str | None:
    """For a multimodal checkpoint (Gemma-3 4B and up, Mistral-3), set ``kwargs`` to load its
    language model alone (its ``text_config``, the weights renamed by
    :data:`LANGUAGE_MODEL_KEYS`) and return the checkpoint's class name; None for any other."""
    from transformers import AutoConfig

    from recipes_lib.calc import language_model_config

    config = AutoConfig.from_pretrained(ident)
    text = language_model_config(config)
    if text is config:
        return None
    kwargs.update(config=text, key_mapping=LANGUAGE_MODEL_KEYS)
    return (config.architectures or [type(config).__name__])[0]


def keep_4bit_compute_dtype(model: torch.nn.Module) -> int:
    """Make bitsandbytes' 4-bit layers compute in their ``compute_dtype`` at inference on CPU too.

    On CPUs with AVX512-BF16, bitsandbytes (>= 0.49) runs an eval-mode, no-grad 4-bit layer
    through a fused bf16 kernel (repacking its weights in place on first use), whatever
    ``bnb_4bit_compute_dtype`` says: faster there, but the same model then computes differently
    in training and inference and from one CPU to the next, and a 4-bit model no longer matches
    its own adapter reloaded or merged. The course keeps the dtype it asked for, on every CPU.

    Args:
        model: a model with bitsandbytes 4-bit layers.

    Returns:
        How many 4-bit layers were switched off that kernel.
    """
    switched = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            switched += 1
    return switched


def small_llama(tokenizer=None, max_positions: int = 512, vocab_size: int | None = None,
                hidden_size: int = 64, num_hidden_layers: int = 2,
                attn_implementation: str = "sdpa", seed: int = 0):
    """A freshly initialised, very small Llama for from-scratch experiments (notebook 04).

    Args:
        tokenizer: gives the vocabulary size and special ids (None: ids 0/1/2).
        max_positions: RoPE positions the config allows.
        vocab_size: overrides the tokenizer's (e.g. 32000 to study the logits' memory).
        hidden_size: width (heads of 32; MLP 3x wide; 2 query heads per kv head).
        num_hidden_layers: depth.
        attn_implementation: "sdpa", "eager" or a registered name.
        seed: initialisation seed.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden_size // 32)
    special = ({"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id} if tokenizer is not None
               else {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    cfg = LlamaConfig(vocab_size=vocab_size or len(tokenizer), hidden_size=hidden_size,
                      intermediate_size=3 * hidden_size, num_hidden_layers=num_hidden_layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=max_positions, tie_word_embeddings=False, **special)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(attn_implementation)
    return model
