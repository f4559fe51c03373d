"""LoRAManager: the adapters a worker holds, and which of them sit in the model's
max_loras slots for the current step."""
from __future__ import annotations

import collections
import logging

import torch

from services.worker.lora.adapter import LoRAAdapter, load_adapter
from services.worker.linear import RowParallelLinear
from services.worker.lora.layer import LoRALayer, TokenSlots
from services.worker.parallel import TensorParallel

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int,
                 tp: TensorParallel, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.tokens = TokenSlots()
        self.device = device
        # (layer index, projection) -> (the layer's LoRALayer, its shard name there)
        self.targets: dict[tuple[int, str], tuple[LoRALayer, str]] = {}
        self.layers: list[LoRALayer] = []
        # A pipeline stage wraps its own layers; an adapter's weights for the
        # others' are theirs to apply.
        self.owns = model.stage.owns
        for index, layer in enumerate(model.model.layers):
            if self.owns(index):
                self._attach(index, layer, model.packed_modules_mapping, tp, dtype)
        self.adapters: dict[int, LoRAAdapter] = {}
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU

    def _attach(self, index: int, layer, packed: dict, tp: TensorParallel,
                dtype: torch.dtype) -> None:
        linears = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
                   "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
        for name, linear in linears.items():
            shards = getattr(linear, "shard_offsets", None) or {name: (0, linear.out_features)}
            linear.lora = LoRALayer(shards, linear.in_features,
                                    isinstance(linear, RowParallelLinear), self.max_loras,
                                    self.max_rank, tp, self.tokens, dtype, self.device)
            self.layers.append(linear.lora)
            for projection, (parent, shard) in packed.items():
                if parent == name:
                    self.targets[(index, projection)] = (linear.lora, shard)
            if name not in (parent for parent, _ in packed.values()):
                self.targets[(index, name)] = (linear.lora, name)

    def add_adapter(self, lora_id: int, path: str) -> None:
        """Reads the adapter (ValueError if llmserve cannot apply it)."""
        adapter = load_adapter(path, self.max_rank)
        unknown = [where for where in adapter.weights
                   if where not in self.targets and self.owns(where[0])]
        if unknown:
            raise ValueError(f"adapter targets {unknown[0]}, which the model does not have")
        self.remove_adapter(lora_id)
        self.adapters[lora_id] = adapter
        logger.info("LoRA adapter %d loaded from %s (rank %d)", lora_id, path, adapter.rank)

    def remove_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self._fill_slot(slot, None)

    def set_step(self, lora_ids: list[int], num_tokens: list[int]) -> None:
        """Each scheduled request's adapter (0: none) and token count, in step order:
        puts the step's adapters in slots and maps every token to its slot."""
        used = sorted({i for i in lora_ids if i})
        if not used:
            self.tokens.slots = None
            return
        if len(used) > self.max_loras:
            raise ValueError(f"{len(used)} adapters in one step; max_loras is {self.max_loras}")
        slot_of = {lora_id: self._slot_for(lora_id, used) for lora_id in used}
        per_request = torch.tensor([slot_of.get(i, -1) for i in lora_ids], dtype=torch.int64)
        self.tokens.slots = per_request.repeat_interleave(
            torch.tensor(num_tokens, dtype=torch.int64)).to(self.device)

    def _slot_for(self, lora_id: int, used: list[int]) -> int:
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return self.slot_of[lora_id]
        if lora_id not in self.adapters:
            raise ValueError(f"LoRA adapter {lora_id} was not loaded into this worker")
        taken = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:  # evict the least recently used adapter this step does not need
            victim = next(i for i in self.slot_of if i not in used)
            slot = self.slot_of.pop(victim)
        self.slot_of[lora_id] = slot
        self._fill_slot(slot, self.adapters[lora_id])
        return slot

    def _fill_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Every layer's slot gets the adapter's weights for it (none: zeros)."""
        by_layer: dict[LoRALayer, dict] = {lora_layer: {} for lora_layer in self.layers}
        for where, weights in (adapter.weights.items() if adapter else []):
            if where not in self.targets:  # a layer of another pipeline stage
                continue
            lora_layer, shard = self.targets[where]
            by_layer[lora_layer][shard] = weights
        for lora_layer, weights in by_layer.items():
            lora_layer.set_slot(slot, weights)
