"""Sleep mode of a model runner: give the device memory back while idle, and take it again.

Two ways, chosen at start (`enable_sleep_mode`):
- without arenas, a sleep empties every tensor (the weights go to host memory at level 1, are
  dropped at level 2 and read again from the checkpoint on waking) and frees the KV cache and
  the CUDA graphs; a wake makes them again;
- with sleep mode's arenas (engine/device_arena.py), the weights and the KV cache live at fixed
  device addresses: a sleep releases the memory under them and a wake maps it back, so the
  tensors and the CUDA graphs that point at them stay (a wake takes well under a second).

RunnerSleep is a part of ModelRunner (it reads and sets the runner's model, caches and graphs);
the runner's `sleep`, `wake_up` and `memory_footprint` call it on every tensor-parallel rank.
"""

from __future__ import annotations

import gc
import os
import weakref
from typing import TYPE_CHECKING

import torch

from llmserve.engine.device_arena import make_arena
from llmserve.engine.weight_stash import WeightStash
from llmserve.model.kv_scales import apply_scales
from llmserve.model.loader import fill_weights

if TYPE_CHECKING:
    from llmserve.engine.model_runner import ModelRunner


class RunnerSleep:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = weakref.proxy(runner)  # no cycle: the runner's memory goes with its last reference
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.tensors().values())
        self.stash = WeightStash()  # the tensors kept in host memory while asleep
        self.asleep = False
        self.dropped: dict[str, tuple[torch.Size, torch.dtype]] = {}  # parameters read again on waking
        self.blocks = (0, 0)  # (device, host swap) blocks of the caches when it fell asleep
        # sleep mode: weights and KV cache in arenas of fixed addresses, so a wake keeps the graphs
        self.weights_arena = self.kv_arena = None
        self.arena_views: dict[str, torch.Tensor] = {}  # each weight's view of its arena
        self.buffer_stash = WeightStash()  # level 2 with arenas: the buffers only
        self.arena_level = 0  # the level of a sleep with arenas

    def tensors(self) -> dict[str, torch.Tensor]:
        model = self.runner.model
        return {**dict(model.named_buffers()), **dict(model.named_parameters())}

    # -- arenas ---------------------------------------------------------------------------
    def move_weights_to_arena(self) -> None:
        """At start: every weight and buffer into one arena (through host memory, so the
        device never holds them twice), each tensor a view of it from now on."""
        device = self.runner.device
        tensors = self.tensors()
        pin = device.type == "cuda"
        self.stash.stash(tensors, pin=pin)
        for tensor in tensors.values():
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
        gc.collect()
        if pin:
            torch.cuda.empty_cache()
        self.weights_arena = make_arena(max(1, self.stash.nbytes), device)
        self.arena_views = self.stash.restore_into(self.weights_arena.tensor)
        for name, view in self.arena_views.items():
            tensors[name].data = view
        if pin:
            torch.cuda.synchronize(device)

    def arena_kv_caches(self, num_blocks: int, shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
        """The KV cache as views of one (new) arena, a tensor of `shape` per cache slot (per layer
        with one KV group)."""
        runner = self.runner
        num_layers = runner.kv_layout.layers_per_group
        per_layer = runner.bytes_per_block * num_blocks // num_layers
        if self.kv_arena is not None:
            self.kv_arena.close()
        self.kv_arena = make_arena(per_layer * num_layers, runner.device)
        self.kv_arena.tensor.zero_()
        return [self.kv_arena.tensor[i * per_layer : (i + 1) * per_layer].view(dtype).view(shape)
                for i in range(num_layers)]  # fmt: skip

    # -- sleep and wake -------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Give the device memory back: the KV cache (and its CUDA graphs) always; at level 1
        the weights move to host memory (pinned on a GPU), at level 2 they are dropped (the
        checkpoint is read again on waking). The engine must be idle: the cache is lost.
        With sleep mode's arenas the CUDA graphs stay: only the memory under them goes."""
        if self.weights_arena is not None:
            self._sleep_in_place(level)
            return
        runner = self.runner
        runner.release_cuda_graphs()
        self.blocks = runner.cache_sizes()
        for layer in runner.model.attention_layers():
            layer.kv_cache = torch.empty(0)
        runner.kv_caches, runner.cpu_caches = [], []
        runner.drop_last_step()
        # level 1 keeps every tensor; level 2 only the buffers (rotary tables), which no
        # checkpoint holds: the parameters are read again on waking
        tensors = dict(runner.model.named_buffers())
        if level == 1:
            tensors.update(runner.model.named_parameters())
        self.stash.stash(tensors, pin=runner.device.type == "cuda")
        self.dropped = {name: (p.shape, p.dtype) for name, p in runner.model.named_parameters() if level == 2}
        for tensor in self.tensors().values():
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=runner.device)
        self.asleep = True
        gc.collect()
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def _sleep_in_place(self, level: int) -> None:
        """Sleep with arenas: the weights' bytes to host memory in one copy (level 1; level 2
        keeps only the buffers), then the arenas' memory goes; tensors and graphs stay."""
        runner = self.runner
        pin = runner.device.type == "cuda"
        self.blocks = runner.cache_sizes()
        runner.cpu_caches = []
        runner.drop_last_step()
        if pin:
            torch.cuda.synchronize(runner.device)
        if level == 1:
            self.stash.save_whole(self.weights_arena.tensor, pin)
        else:
            self.buffer_stash.stash(dict(runner.model.named_buffers()), pin=pin)
            self.stash.host = None  # nothing of the weights is kept
        self.arena_level = level
        self.weights_arena.release()
        if self.kv_arena is not None:
            self.kv_arena.release()
        self.asleep = True

    def wake_up(self) -> None:
        """Weights back on the device (from host memory, or read again), an empty KV cache of
        the same size, the kernels and CUDA graphs ready again (with sleep mode's arenas the
        graphs never went)."""
        if self.weights_arena is not None:
            self._wake_in_place()
            return
        runner = self.runner
        tensors = self.tensors()
        for name, view in self.stash.restore(runner.device).items():
            tensors[name].data = view
        for name, (shape, dtype) in self.dropped.items():
            tensors[name].data = torch.empty(shape, dtype=dtype, device=runner.device)
        if self.dropped:
            self._read_weights_again()
            self.stash.release()
        self.dropped, self.asleep = {}, False
        runner.init_kv_cache(*self.blocks)
        runner.capture_cuda_graphs()

    def _wake_in_place(self) -> None:
        runner = self.runner
        self.weights_arena.map()
        if self.arena_level == 2:  # the buffers back, the parameters read again into their views
            self.buffer_stash.copy_back(self.arena_views)
            self.buffer_stash.release()
            self._read_weights_again()
            for name, tensor in self.tensors().items():  # a loader that made new tensors: into the arena
                view = self.arena_views[name]
                if tensor.data_ptr() != view.data_ptr():
                    view.copy_(tensor.data)
                    tensor.data = view
        else:
            self.weights_arena.tensor[: self.stash.nbytes].copy_(self.stash.host[: self.stash.nbytes],
                                                                 non_blocking=runner.device.type == "cuda")  # fmt: skip
        if self.kv_arena is not None:
            self.kv_arena.map()
            self.kv_arena.tensor.zero_()  # blocks never written read as zeros, as after a fresh start
        runner.init_cpu_caches(self.blocks[1])
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        self.arena_level, self.asleep = 0, False

    def _read_weights_again(self) -> None:
        runner = self.runner
        mc = runner.config.model_config
        fill_weights(runner.model, mc.model, mc.arch, mc.load_format, mc.seed, runner.tp, progress=False)
        if (
            runner.kv_scales.scales
        ):  # a reload puts a checkpoint's KV scales back: keep the ones in use (and in the graphs)
            apply_scales(runner.model, runner.kv_scales)

    # -- what it holds ----------------------------------------------------------------------
    def memory_footprint(self) -> dict:
        """`weight_bytes` and `kv_cache_bytes` of the engine awake (the same asleep), and the
        bytes its tensors hold on the device now (`device_bytes`; on a GPU also what torch's
        allocator has handed out, `allocated_bytes`)."""
        runner = self.runner
        on_device = sum(t.numel() * t.element_size() for t in self.tensors().values())
        kv_now = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        if self.asleep and self.weights_arena is not None:  # the views stay; the memory under them went
            on_device = kv_now = 0
        blocks = self.blocks[0] if self.asleep else runner.cache_sizes()[0]
        row = {"weight_bytes": self.weight_bytes, "kv_cache_bytes": blocks * runner.bytes_per_block,
               "device_bytes": on_device + kv_now}  # fmt: skip
        device = runner.device
        if device.type == "cuda":
            row["allocated_bytes"] = torch.cuda.memory_allocated(device)
            # what torch's allocator holds besides the weights and KV cache (graph pools,
            # activations, buffers): stays while asleep (the CUDA context, ~0.5 GiB, is not counted)
            reserved = torch.cuda.memory_reserved(device)
            row["overhead_bytes"] = (
                reserved if self.weights_arena is not None else max(0, reserved - row["device_bytes"])
            )
            row["device_total_bytes"] = torch.cuda.mem_get_info(device)[1]
        else:  # the host's memory is this device's
            row["overhead_bytes"] = 0
            row["device_total_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return row
