"""The Engine's control-plane methods: weights, memory, cache and self-checks. Each is one control
command to the scheduler (see scheduler/control.py), answered once it has been carried out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from radixserve.protocol.messages import ControlResult
from radixserve.protocol.sampling_params import InvalidRequestError


class EngineControl(ABC):
    """Mixed into Engine, which provides control()."""

    @abstractmethod
    def control(
        self, command: str, timeout: float = 60.0, args: dict[str, Any] | None = None
    ) -> ControlResult: ...

    def update_weights_from_disk(self, model_path: str, timeout: float = 600.0) -> None:
        """Serves another checkpoint of the same architecture; requests in flight are aborted.
        A failure raises and leaves the old weights serving."""
        result = self.control("update_weights_from_disk", timeout, {"model_path": model_path})
        if not result.ok:
            raise InvalidRequestError(f"weight update failed: {result.error}")

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], flush_cache: bool = True, timeout: float = 600.0
    ) -> int:
        """Loads tensors named as in the checkpoint (e.g. "model.layers.0.mlp.up_proj.weight") in
        place; all or nothing. Requests in flight are aborted; the cache is flushed unless told not
        to. Returns how many tensors were used. They travel as safetensors bytes, never pickled."""
        from safetensors.torch import save

        data = save({name: tensor.detach().cpu().contiguous() for name, tensor in named_tensors})
        result = self.control(
            "update_weights_from_tensor", timeout, {"tensors": data, "flush_cache": flush_cache}
        )
        if not result.ok:
            raise InvalidRequestError(f"weight update failed: {result.error}")
        used: int = result.payload["num_updated"]
        return used

    def release_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        """Frees the weights and/or KV cache (tags "weights", "kv_cache"; default both) while idle;
        requests are refused until resume. Returns what is released now."""
        return self._memory_command("release_memory_occupation", tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        return self._memory_command("resume_memory_occupation", tags)

    def _memory_command(self, command: str, tags: list[str] | None) -> list[str]:
        result = self.control(command, 600.0, {"tags": tags})
        if not result.ok:
            raise InvalidRequestError(result.error or f"{command} failed")
        released: list[str] = result.payload["released"]
        return released

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        result = self.control("get_weights_by_name", 60.0, {"name": name, "truncate_size": truncate_size})
        if not result.ok:
            raise InvalidRequestError(result.error or f"cannot read {name}")
        values: list[float] = result.payload["values"]
        return values

    def check_kv_invariant(self, timeout: float = 60.0) -> None:
        """Raises if KV slots leaked. The scheduler answers once it is idle."""
        result = self.control("check_kv_invariant", timeout=timeout)
        if not result.ok:
            raise AssertionError(f"KV accounting invariant failed: {result.error}")

    def get_stats(self) -> dict[str, Any]:
        return self.control("get_stats").payload

    def start_expert_distribution_record(self) -> None:
        """A Mixture-of-Experts model counts, from zero, the tokens each layer routes to each expert."""
        self._expert_command("start_expert_distribution_record")

    def stop_expert_distribution_record(self) -> None:
        self._expert_command("stop_expert_distribution_record")

    def dump_expert_distribution_record(self) -> dict[int, list[int]]:
        """Per sparse layer (by index), the tokens routed to each expert in the last recording."""
        layers = self._expert_command("dump_expert_distribution_record")["layers"]
        return {int(layer): counts for layer, counts in layers.items()}

    def _expert_command(self, command: str) -> dict[str, Any]:
        result = self.control(command)
        if not result.ok:
            raise InvalidRequestError(result.error or f"{command} failed")
        return result.payload

    def flush_cache(self) -> bool:
        return self.control("flush_cache").ok

    # The LoRA adapters loaded (--enable-lora), by name: what requests and OpenAI's `model` may name.
    lora_adapters: dict[str, str]

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """Loads a PEFT adapter under a name; returns every adapter loaded (name: path). A bad
        adapter (unknown format, rank too high, another base model's shapes) raises and loads nothing."""
        result = self.control("load_lora_adapter", 600.0, {"lora_name": lora_name, "lora_path": lora_path})
        if not result.ok:
            raise InvalidRequestError(result.error or "loading the LoRA adapter failed")
        return self._track_adapters(result.payload["loaded_adapters"])

    def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """Unloads an adapter; refused while requests in flight use it (retry when they finish)."""
        result = self.control("unload_lora_adapter", 60.0, {"lora_name": lora_name})
        if not result.ok:
            raise InvalidRequestError(result.error or "unloading the LoRA adapter failed")
        return self._track_adapters(result.payload["loaded_adapters"])

    def _track_adapters(self, loaded: dict[str, str]) -> dict[str, str]:
        # In place: the request builder checks names against this very table.
        self.lora_adapters.clear()
        self.lora_adapters.update(loaded)
        return dict(loaded)

    def clear_hicache_storage_backend(self) -> bool:
        """Removes every page the storage tier keeps (flush_cache empties the device tree alone)."""
        return self.control("clear_hicache_storage_backend").ok
