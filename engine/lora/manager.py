"""Which adapters the engine knows, which sit in host memory, which in the GPU slots (LRU).

Registered adapters (a name and a folder) are checked when added. Their weights stay in host
memory for the `max_cpu_loras` most recently used and are read again from their folder when
needed after that. A step's adapters are brought into the `max_loras` device slots before it
runs, replacing the least recently used adapters that the step does not use; the scheduler never
runs more distinct adapters in one step than there are slots.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from kvfleet.engine.config import ModelConfig
from kvfleet.engine.lora.adapter import LoRAAdapter, LoRAError, LoRANotFoundError, load_adapter
from kvfleet.engine.lora.layers import LoRAContext, LoRALinear, attach_lora
from kvfleet.engine.lora.ops import LoRABatch
from kvfleet.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        use_triton: bool,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be >= 1")
        if max_cpu_loras < max_loras:
            raise ValueError(
                f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})"
            )
        self.config: ModelConfig = model.config
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self.device = next(model.parameters()).device
        self.context = LoRAContext(use_triton=use_triton)
        self.layers: list[LoRALinear] = attach_lora(model, max_loras, max_rank, self.context)
        self._paths: dict[str, str] = {}  # every registered adapter
        self._users: dict[str, int] = {}  # unfinished requests per adapter
        self._draining: set[str] = set()  # unloaded while in use: removed when the last ends
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident: name -> slot, LRU first
        self.num_loads = 0  # adapters copied into a slot (tests and metrics read it)

    @property
    def names(self) -> list[str]:
        """Adapters requests may name (not those being unloaded)."""
        return [n for n in self._paths if n not in self._draining]

    @property
    def resident(self) -> list[str]:
        """Adapters in device slots, least recently used first."""
        return list(self._slots)

    def acquire(self, name: str) -> None:
        """A request will use `name`: its weights stay in host memory until `release`."""
        if name not in self._paths or name in self._draining:
            raise LoRANotFoundError(f"the adapter {name!r} does not exist")
        self._host_adapter(name)
        self._users[name] = self._users.get(name, 0) + 1

    def release(self, name: str) -> bool:
        """A request using `name` ended; True if that removed an adapter being unloaded."""
        self._users[name] -= 1
        if self._users[name] == 0:
            del self._users[name]
            if name in self._draining:
                self._forget(name)
                return True
        return False

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Register and check an adapter; LoRAError (nothing registered) if it cannot serve."""
        if not name or name in self._paths:
            raise LoRAError(f"an adapter named {name!r} is already loaded" if name else "no name")
        adapter = load_adapter(name, path, self.config, self.max_rank)
        self._paths[name] = adapter.path
        self._keep_on_host(adapter)
        logger.info("LoRA adapter %r added: rank %d from %s", name, adapter.rank, adapter.path)
        return adapter

    def remove(self, name: str) -> int:
        """Unload an adapter. New requests can no longer name it; requests already using it
        finish first. Returns how many that is (0: gone now)."""
        if name not in self._paths or name in self._draining:
            raise LoRANotFoundError(f"the adapter {name!r} does not exist")
        users = self._users.get(name, 0)
        if users:
            self._draining.add(name)
            logger.info("LoRA adapter %r unloading after its %d requests finish", name, users)
        else:
            self._forget(name)
        return users

    def _forget(self, name: str) -> None:
        del self._paths[name]
        self._draining.discard(name)
        self._host.pop(name, None)
        self._slots.pop(name, None)
        logger.info("LoRA adapter %r removed", name)

    def prepare_step(
        self, row_adapters: Sequence[str | None], num_tokens: np.ndarray
    ) -> LoRABatch | None:
        """Bring the step's adapters into slots and group its tokens by slot. `row_adapters`:
        each request row's adapter name; `num_tokens`: its token count this step."""
        slots = self.activate(name for name in row_adapters if name is not None)
        row_slots = np.fromiter(
            (self.max_loras if name is None else slots[name] for name in row_adapters),
            np.int64,
            len(row_adapters),
        )
        batch = LoRABatch.build(np.repeat(row_slots, num_tokens), self.max_loras, self.device)
        self.context.batch = batch
        return batch

    def activate(self, names: Iterable[str]) -> dict[str, int]:
        """Slots for `names` (at most max_loras distinct), loading the missing ones."""
        wanted = list(dict.fromkeys(names))
        assert len(wanted) <= self.max_loras, "the scheduler bounds adapters per step"
        for name in wanted:
            if name in self._slots:
                self._slots.move_to_end(name)
        for name in wanted:
            if name not in self._slots:
                self._load_into_slot(name, wanted)
        return {name: self._slots[name] for name in wanted}

    def _load_into_slot(self, name: str, in_use: list[str]) -> None:
        taken = set(self._slots.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(n for n in self._slots if n not in in_use)
            slot = self._slots.pop(victim)
            logger.debug("LoRA slot %d: %r out, %r in", slot, victim, name)
        adapter = self._host_adapter(name)
        for layer in self.layers:
            layer.set_slot(slot, adapter)
        self._slots[name] = slot
        self.num_loads += 1

    def _host_adapter(self, name: str) -> LoRAAdapter:
        adapter = self._host.get(name)
        if adapter is None:
            # Read again: raises LoRAError if the folder changed since the adapter was added.
            adapter = load_adapter(name, self._paths[name], self.config, self.max_rank)
            self._keep_on_host(adapter)
        self._host.move_to_end(name)
        return adapter

    def _keep_on_host(self, adapter: LoRAAdapter) -> None:
        """NOTE: adapters with unfinished requests are never dropped, so a step never reads a
        folder; host memory may then exceed max_cpu_loras until they finish."""
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        idle = [n for n in self._host if n not in self._users and n != adapter.name]
        while len(self._host) > self.max_cpu_loras and idle:
            del self._host[idle.pop(0)]

    def clear_step(self) -> None:
        self.context.batch = None
