"""LoRA adapters on the embedded engine: peft directories read safely, one adapter merged in.

- **Merged, one active adapter.** The engine keeps a copy of the base weights of the modules an
  adapter targets and serves ``W + scaling * B @ A`` of the active adapter (merged in float32,
  cast to the weight's dtype): decode runs the base kernels unchanged, CUDA graphs and the paged
  path's fused copies included (refreshed in place), and a load is a weight update of the
  targets alone (pause/drain, prefix cache flushed, ``weight_version`` set when given). Loading
  makes the new adapter the active one; unloading the active one restores the base.
- **Names** are SGLang's: ``/generate``'s ``lora_path`` names a loaded adapter; ``None`` or the
  active name is served; a loaded but inactive name is refused (one adapter at a time); an
  unknown name is refused as SGLang refuses it.
- **Inputs bounded before work**: a name of at most ``MAX_NAME_CHARS``, at most ``MAX_LOADED``
  adapters, ``adapter_config.json`` of at most ``MAX_CONFIG_BYTES``, ``adapter_model.safetensors``
  no larger than the model's own weights could be; regular files only (a FIFO would block the
  reader); every tensor name, rank and shape checked against the base before anything changes.

:class:`AdapterSet` holds the state; :class:`LoraServing` is :class:`LocalEngine`'s public
surface for it (a mixin).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from agentrl.errors import ServerError
from agentrl.inference.engine.worker import in_worker

if TYPE_CHECKING:
    from agentrl.inference.engine.paged_runner import PagedRunner

PEFT_PREFIX = "base_model.model."  # peft's key prefix (the learner's lora.PEFT_PREFIX)
MAX_NAME_CHARS = 256
MAX_LOADED = 64  # adapters loaded at once (SGLang bounds it too: --max-loaded-loras)
MAX_CONFIG_BYTES = 1024**2
INLINE_SOURCE = "<tensors>"  # loaded_lora_adapters' path of an in-process push
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PARTS = ("lora_A", "lora_B")


class AdapterError(ValueError):
    """An adapter refused: one line saying why (a 400 on the server)."""


@dataclass(frozen=True)
class Adapter:
    """A checked adapter: ``(A, B)`` per module (on the engine's device) and its scaling."""

    source: str
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float


def check_name(name: object) -> str:
    """``name`` if it is a usable adapter name (a non-empty string of bounded length)."""
    if not isinstance(name, str) or not name:
        raise AdapterError(f"lora_name: expected a non-empty string, got {name!r:.80}")
    if len(name) > MAX_NAME_CHARS:
        raise AdapterError(f"lora_name: at most {MAX_NAME_CHARS} characters, got {len(name)}")
    return name


def max_adapter_bytes(model: torch.nn.Module) -> int:
    """The largest adapter file read: the model's values as float64 (rank <= min(in, out))."""
    return sum(p.numel() for p in model.parameters()) * 8 + 16 * 2**20


def _regular(file: Path, limit: int) -> None:
    try:
        info = os.stat(file)
    except FileNotFoundError:
        raise AdapterError(
            f"lora_path: {str(file.parent)!r} holds no {file.name} (a peft adapter directory "
            f"has {CONFIG_FILE} and {WEIGHTS_FILE})"
        ) from None
    except OSError as exc:
        raise AdapterError(f"lora_path: cannot stat {file.name}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise AdapterError(f"lora_path: {file.name} is not a regular file")
    if info.st_size > limit:
        raise AdapterError(f"lora_path: {file.name} has {info.st_size} bytes, over {limit}")


def peft_scaling(config: Any) -> tuple[float, int]:
    """``(scaling, rank)`` of a peft LoRA config (``lora_alpha / r``; rsLoRA: ``/ sqrt(r)``)."""
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE}: expected a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {config['peft_type']!r:.40} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r: expected a positive integer, got {rank!r:.40}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{CONFIG_FILE}: lora_alpha: expected a number, got {alpha!r:.40}")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):  # per-module ranks, DoRA, extra trained modules: not merged here
            raise AdapterError(f"{CONFIG_FILE}: {key} is not supported by agentrl's engine")
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    return float(alpha) / root, rank


def read_peft_adapter(path: str | Path, max_bytes: int) -> tuple[dict[str, torch.Tensor], float]:
    """The tensors and scaling of a peft adapter directory, sizes bounded before reading.

    Raises:
        AdapterError: not a directory, a file missing, not regular or too large, a config or
            tensor file that does not parse, or lora_A ranks other than the config's ``r``.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"lora_path: expected a peft adapter directory, got {str(path)!r}")
    _regular(folder / CONFIG_FILE, MAX_CONFIG_BYTES)
    _regular(folder / WEIGHTS_FILE, max_bytes)
    try:
        config = json.loads((folder / CONFIG_FILE).read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE}: not JSON ({exc})") from None
    scaling, rank = peft_scaling(config)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except Exception as exc:  # a corrupt or truncated file: the caller's input
        raise AdapterError(f"{WEIGHTS_FILE}: cannot read it ({exc})") from None
    for key, value in tensors.items():
        if key.endswith(".lora_A.weight") and value.shape[0] != rank:
            raise AdapterError(f"{WEIGHTS_FILE}: {key} has rank {value.shape[0]}, config r={rank}")
    return tensors, scaling


def adapter_pairs(
    adapter: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``module -> (A, B)`` of ``adapter`` (peft names or ours), checked against ``params``.

    Raises:
        AdapterError: a key that is no LoRA weight, a module the base lacks, an incomplete
            pair, or shapes that do not fit the base weight (``A (r, in)``, ``B (out, r)``).
    """
    if not adapter:
        raise AdapterError("adapter: no lora_A/lora_B tensors")
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in adapter.items():
        name = key.removeprefix(PEFT_PREFIX)
        part = next((p for p in _PARTS if name.endswith(f".{p}.weight")), None)
        if part is None or not isinstance(value, torch.Tensor):
            raise AdapterError(f"adapter: {key!r:.120} is not a lora_A/lora_B weight")
        found.setdefault(name[: -len(f".{part}.weight")], {})[part] = value
    pairs = {}
    for module, pair in found.items():
        base = params.get(f"{module}.weight")
        if base is None or base.dim() != 2:
            raise AdapterError(f"adapter: the model has no linear module {module!r:.120}")
        if set(pair) != set(_PARTS):
            raise AdapterError(f"adapter: {module} lacks lora_A or lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        fits = a.dim() == b.dim() == 2 and a.shape[0] == b.shape[1] >= 1
        if not fits or (b.shape[0], a.shape[1]) != tuple(base.shape):
            raise AdapterError(
                f"adapter: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; the base weight "
                f"is {tuple(base.shape)} (expected A (r, {base.shape[1]}), B ({base.shape[0]}, r))"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"adapter: {module} has non-float tensors ({a.dtype}, {b.dtype})")
        pairs[module] = (a, b)
    return pairs


class AdapterSet:
    """The adapters loaded on one model, the active one merged into its weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded: dict[str, Adapter] = {}
        self.active: str | None = None
        self._base: dict[str, torch.Tensor] = {}  # module -> its base weight (kept: reloads)
        self._merged: set[str] = set()  # modules whose weight is not their base now

    def listing(self) -> dict[str, str]:
        """``name -> path`` (``"<tensors>"`` for an in-process push), in load order."""
        return {name: a.source for name, a in self.loaded.items()}

    def refusal(self, lora_path: str | None) -> str | None:
        """Why a request naming ``lora_path`` cannot run here, or ``None``."""
        if lora_path is None or lora_path == self.active:
            return None
        if not isinstance(lora_path, str) or lora_path not in self.loaded:
            loaded = sorted(self.loaded)
            return (
                f"The following requested LoRA adapters are not loaded: {str(lora_path)[:256]}\n"
                f"Loaded adapters: {loaded}"
            )
        return (
            f"LoRA adapter {lora_path!r} is loaded but not active (active: {self.active!r}); "
            "agentrl's engine serves one adapter at a time: load it again to activate it"
        )

    def prepare(
        self, name: str, adapter: dict[str, torch.Tensor], scaling: float, source: str
    ) -> Adapter:
        """Check ``adapter`` against the model and copy it to the model's device (float32)."""
        check_name(name)
        if name in self.loaded:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        if len(self.loaded) >= MAX_LOADED:
            raise AdapterError(f"at most {MAX_LOADED} LoRA adapters may be loaded at once")
        if not math.isfinite(scaling):
            raise AdapterError(f"scaling: expected a finite number, got {scaling!r}")
        params = dict(self.model.named_parameters())
        pairs = adapter_pairs(adapter, params)
        device = next(iter(params.values())).device
        own = {  # copies: the learner keeps training its own tensors
            m: (a.to(device, torch.float32, copy=True), b.to(device, torch.float32, copy=True))
            for m, (a, b) in pairs.items()
        }
        return Adapter(source, own, float(scaling))

    @torch.no_grad()
    def merge(self, name: str | None) -> None:
        """Serve adapter ``name`` (``None``: the base): restore, then merge its modules."""
        params = dict(self.model.named_parameters())
        pairs = {} if name is None else self.loaded[name].pairs
        for module in self._merged - set(pairs):
            params[f"{module}.weight"].copy_(self._base[module])
        self._merged.clear()
        scaling = 0.0 if name is None else self.loaded[name].scaling
        for module, (a, b) in pairs.items():
            weight = params[f"{module}.weight"].detach()
            if module not in self._base:
                self._base[module] = weight.clone()
            base = self._base[module]
            if weight.dtype == torch.float32:  # straight into the weight: no temporary
                torch.addmm(base, b, a, alpha=scaling, out=weight)
            else:
                weight.copy_(torch.addmm(base.float(), b, a, alpha=scaling))
            self._merged.add(module)
        self.active = name

    def base_replaced(self) -> None:
        """A full weight update replaced the base: no adapter is merged in any more."""
        self._base.clear()
        self._merged.clear()
        self.active = None


class LoraServing:
    """:class:`LocalEngine`'s adapter surface (SGLang's ``/load_lora_adapter`` and kin)."""

    if TYPE_CHECKING:
        model: torch.nn.Module
        _adapters: AdapterSet
        _paged: PagedRunner | None

        async def _swap(
            self, what: str, weight_version: int | None, apply: Callable[[], Awaitable[None]]
        ) -> None: ...

    @property
    def loaded_lora_adapters(self) -> dict[str, str]:
        """The loaded adapters: ``name -> path`` (``"<tensors>"`` when pushed in process)."""
        return self._adapters.listing()

    @property
    def active_lora_adapter(self) -> str | None:
        """The adapter merged into the served weights (``None``: the base)."""
        return self._adapters.active

    def check_lora(self, lora_path: str | None, rid: str | None = None) -> None:
        """Raise the 400 ``ServerError`` that ``generate(lora_path=...)`` would raise, if any."""
        if (why := self._adapters.refusal(lora_path)) is not None:
            raise ServerError(why, endpoint="local", rid=rid, status=400)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the peft adapter directory ``path`` as ``name`` and serve it (SGLang's route).

        Raises:
            ServerError: 400 with the reason (see :func:`read_peft_adapter`, :func:`adapter_pairs`).
        """
        try:
            check_name(name)
            tensors, scaling = await in_worker(
                read_peft_adapter, path, max_adapter_bytes(self.model)
            )
        except AdapterError as exc:
            raise ServerError(
                f"load_lora_adapter failed: {exc}", endpoint="local", status=400
            ) from None
        await self.load_lora_adapter_tensors(name, tensors, scaling, source=str(path))

    async def load_lora_adapter_tensors(
        self,
        name: str,
        adapter: dict[str, torch.Tensor],
        scaling: float,
        weight_version: int | None = None,
        *,
        source: str = INLINE_SOURCE,
    ) -> None:
        """Load ``adapter`` (``lora_A``/``lora_B`` under peft's names or ours) and serve it.

        Only these tensors move; they are copied, so the caller may keep training its own.
        Like a weight update: waits for the running batch (applies at once when paused),
        flushes the prefix cache and sets ``weight_version`` when given.

        Raises:
            ServerError: 400: a bad name, a name already loaded, or tensors that do not fit.
        """
        try:
            prepared = self._adapters.prepare(name, adapter, scaling, source)
        except AdapterError as exc:
            raise ServerError(
                f"load_lora_adapter failed: {exc}", endpoint="local", status=400
            ) from None

        async def apply() -> None:
            if name in self._adapters.loaded:  # a concurrent load of the same name won
                raise AdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
            self._adapters.loaded[name] = prepared
            try:
                await in_worker(self._merge, name)
            except BaseException:
                self._adapters.loaded.pop(name, None)
                raise

        await self._swap("load_lora_adapter", weight_version, apply)

    async def unload_lora_adapter(self, name: str) -> None:
        """Forget adapter ``name``; the active one's merge is undone (the base is served).

        Raises:
            ServerError: 400 when ``name`` is not loaded.
        """
        if name in self._adapters.loaded and self._adapters.active != name:
            del self._adapters.loaded[name]  # not served: nothing to drain for
            return

        async def apply() -> None:
            if name not in self._adapters.loaded:
                raise AdapterError(f"LoRA adapter {str(name)[:MAX_NAME_CHARS]!r} is not loaded")
            if self._adapters.active == name:
                await in_worker(self._merge, None)
            del self._adapters.loaded[name]

        await self._swap("unload_lora_adapter", None, apply)

    def _merge(self, name: str | None) -> None:
        self._adapters.merge(name)
        if self._paged is not None:  # its fused compute-dtype copies, refreshed in place
            self._paged.refresh_weights()
