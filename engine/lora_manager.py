"""Which LoRA adapters are on the model: lora_modules' for the engine's life; lora_root's read on a loader thread when
a request first names one, put into a slot of every linear between steps, and past max_loras dropped least recently
used first once no request runs them (its slot zeroed and freed). Reading and shaping an adapter (28 ms for SmolLM2
at rank 16) stays off the step loop, so a client naming adapter after adapter does not stall everyone's streams;
putting it into its slots takes the loop ~9 ms, a drop ~5 (BENCHMARKS.md)."""
from __future__ import annotations

import ctypes
import functools
import logging
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from engine.config import EngineConfig, LoRAModule
from engine.errors import EngineInputError
from engine.layers.linear import Linear
from engine.layers.lora import LinearLoRA, LoRAStep
from engine.models.lora import LoRAAdapter, prepare_adapter

log = logging.getLogger(__name__)


class LoRAManager:
    """An adapter's `key` starts its prefix-cache chains: its name, and for one from lora_root the weights file's size
    and time, so blocks of an adapter since replaced on disk serve no one."""

    def __init__(self, model, config: EngineConfig):
        self.model, self.config = model, config
        self.static = config.lora_module_names
        slots = len(self.static) + (config.max_loras if config.lora_root is not None else 0)
        self.step = LoRAStep(slots)
        model.lora_step = model.model.lora_step = self.step
        self.free = list(range(slots - 1, -1, -1))  # popped lowest first
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.keys: dict[str, str] = {}
        for module in config.lora_modules:
            self._install(prepare_adapter(model, module, config.max_lora_rank), module.name)
        self.loading: dict[str, Future] = {}
        self.num_loads = 0  # lora_root adapters installed, each time again after being dropped
        self._loader: ThreadPoolExecutor | None = None

    def use(self, name: str) -> str:
        """A loaded adapter's prefix-cache key, marking it the most recently used."""
        self.adapters.move_to_end(name)
        return self.keys[name]

    def start_loading(self, name: str) -> None:
        if name not in self.adapters and name not in self.loading:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
            self.loading[name] = self._loader.submit(self._read, name)

    def install_loaded(self, in_use: set[str], wait_s: float = 0.0) -> dict[str, EngineInputError | None]:
        """Install every adapter whose read has finished (waiting up to `wait_s` for one), in the slot of an idle one
        dropped for it where max_loras are loaded: name -> None where it is now loaded, else why it cannot be."""
        if wait_s and self.loading:
            wait(list(self.loading.values()), wait_s, FIRST_COMPLETED)
        results: dict[str, EngineInputError | None] = {}
        for name in [name for name, future in self.loading.items() if future.done()]:
            try:
                adapter, key = self.loading.pop(name).result()
                self.drop_idle(in_use, room_for=1)
                self._install(adapter, key)
                results[name] = None
                self.num_loads += 1
                log.info("loaded LoRA adapter %s (rank %d)", name, self.adapters[name].rank)
            except EngineInputError as exc:
                results[name] = exc
        return results

    @property
    def past_limit(self) -> bool:
        """More lora_root adapters loaded than max_loras (those in use when the others came)."""
        return len(self.adapters) - len(self.static) > self.config.max_loras

    def drop_idle(self, in_use: set[str], room_for: int = 0) -> list[str]:
        """Drop loaded lora_root adapters past max_loras (less `room_for`), least recently used first, that no
        request runs."""
        dynamic = [name for name in self.adapters if name not in self.static]
        excess = len(dynamic) + room_for - self.config.max_loras
        dropped = [name for name in dynamic if name not in in_use][: max(0, excess)]
        for name in dropped:
            slot = self.step.index.pop(name)
            del self.adapters[name], self.keys[name]
            for linear in self._linears():
                if linear.lora is not None and slot in linear.lora.filled:
                    linear.lora.clear(slot)
            self.free.append(slot)
        self._count_used()
        return dropped

    def _count_used(self) -> None:
        self.step.used = max(self.step.index.values(), default=-1) + 1

    def _read(self, name: str) -> tuple[LoRAAdapter, str]:
        _one_openmp_thread()  # a pool of this thread's own would spin beside the step's on the same cores
        path = self.config.lora_path(name)
        if path is None:
            raise EngineInputError(f"LoRA adapter {name[:256]!r} is not served here", "lora_name")
        try:
            identity = _file_identity(Path(path) / "adapter_model.safetensors")  # before reading: a later change reloads
            adapter = prepare_adapter(self.model, LoRAModule(name=name, path=path), self.config.max_lora_rank)
        except Exception as exc:  # a broken adapter fails its requests, never the engine
            raise EngineInputError(f"LoRA adapter {name!r} could not be loaded: {exc}", "lora_name") from exc
        return adapter, f"{name}@{identity}"

    def _install(self, adapter: LoRAAdapter, key: str) -> None:
        """On the step's thread: the adapter into a free slot of every linear it adapts (a linear grows where the
        adapter is wider than its slots; every linear grows where no slot is free, which only adapters in use past
        max_loras cause)."""
        slot = self.free.pop() if self.free else self._grow()
        for path, (down, up) in adapter.pairs.items():
            linear = self.model.get_submodule(path)
            if linear.lora is None:
                linear.lora = LinearLoRA(self.step, self.step.slots, down.shape[1], linear.in_features,
                                         linear.out_features, self.model.model.embed_tokens.weight)
            elif down.shape[1] > linear.lora.width:
                linear.lora = linear.lora.resized(self.step.slots, down.shape[1])
            linear.lora.put(slot, down, up)
        self.adapters[adapter.name], self.keys[adapter.name] = adapter, key
        self.step.index[adapter.name] = slot
        self._count_used()

    def _grow(self) -> int:
        """Room for max_loras more adapters in every linear; the first new slot."""
        first = self.step.slots
        self.step.slots += max(1, self.config.max_loras)
        for linear in self._linears():
            if linear.lora is not None:
                linear.lora = linear.lora.resized(self.step.slots, linear.lora.width)
        self.free.extend(range(self.step.slots - 1, first, -1))
        return first

    def _linears(self) -> list[Linear]:
        return [m for m in self.model.model.layers.modules() if isinstance(m, Linear)]


def _one_openmp_thread() -> None:
    """OpenMP teams of one for the calling thread only. torch.set_num_threads would not do: ATen keeps one count for
    the process, which a thread that has not yet run a torch op (a step loop started later) takes as its own. ATen
    sets a thread's team size at its first torch call, so that call comes first."""
    set_num_threads = _omp_set_num_threads()
    if set_num_threads is not None:
        torch.get_num_threads()
        set_num_threads(1)


@functools.cache
def _omp_set_num_threads():
    """The OpenMP runtime torch loaded (its own libgomp), or None (not Linux, or another runtime)."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libgomp" in line), None)
    except OSError:
        return None
    return None if path is None else ctypes.CDLL(path).omp_set_num_threads


def _file_identity(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"
