"""StreamingFFN: the naive and hybrid modes' FFN layer: resident bundles (hybrid) and the rest re-read from flash
for every forward into one staging buffer shared by the layers."""

from __future__ import annotations


import torch
from torch import nn

from flashllm_ext.flash.cache import input_bias_role, layer_input_bias
from flashllm_ext.flash.reader import FlashReader
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.flash.transfer import HostTransfer, Transfer
from flashllm_ext.flash.ffn import (
    FFNStats,
    as_ffn_output,
    as_float32,
    as_kernel_input,
    bundle_ffn,
    check_ffn_input,
    kernel_input_dtype,
    output_bias,
    store_activation,
)


class StreamingFFN(nn.Module):
    """One FFN layer computed densely: bundles [0, resident_rows) held in DRAM, the rest re-read from flash on every
    forward into `staging` (shared between layers: [>= n - resident_rows, row_width] of the store's row_dtype). On a
    device, resident bundles and `staging` live there and the reads reach it through `transfer` (a StagedTransfer
    with the same device as `staging`).

    landing (instead of staging; host memory, a dense or quantized store): an aligned uint8 buffer shared between
    layers, at least FlashReader.range_bytes of each layer's streamed bundles, which lie back to back on the file:
    they are read in place (FlashReader.read_range), each byte moved once by the disk, and computed where they land
    (`staging` is then this layer's view of it)."""

    def __init__(
        self,
        store: FlashStore,
        layer: int,
        resident_rows: int,
        staging: torch.Tensor | None,
        reader: FlashReader,
        stats: FFNStats | None = None,
        transfer: Transfer | None = None,
        landing: torch.Tensor | None = None,
    ):
        super().__init__()
        n = store.n_neurons
        if not 0 <= resident_rows <= n:
            raise ValueError(f"resident_rows must be in [0, {n}], got {resident_rows}")
        self.landing, self.streamed_range = landing, None
        if (landing is None) == (staging is None):
            raise ValueError("give exactly one of staging and landing")
        if landing is not None:
            if store.endor or (transfer is not None and transfer.staged):
                raise ValueError("landing reads bundles in place: a dense or quantized store, in host memory")
            loc = store.layer_location(layer)
            self.streamed_range = (loc.offset + resident_rows * loc.row_bytes, (n - resident_rows) * loc.row_bytes)
            rows, _ = reader.range_view(*self.streamed_range, landing)
            staging = rows.view(store.row_dtype).view(n - resident_rows, store.row_width)
        if staging.shape[0] < n - resident_rows or staging.shape[1:] != (store.row_width,):
            raise ValueError(
                f"staging must hold {n - resident_rows} bundles of width {store.row_width}, got {tuple(staging.shape)}"
            )
        self.transfer = transfer if transfer is not None else HostTransfer()
        if staging.device.type != self.transfer.device.type:
            raise ValueError(f"staging is on {staging.device} but the transfer places rows on {self.transfer.device}")
        if self.transfer.staged:
            self.transfer.reserve((n - resident_rows) * store.row_bytes)
        self.store, self.layer, self.reader, self.staging = store, layer, reader, staging
        self.activation = store_activation(store)
        self.input_dtype = kernel_input_dtype(store, layer)
        self.stats = stats if stats is not None else FFNStats()
        bias = layer_input_bias(store, layer)
        device = staging.device
        self.resident = None
        if resident_rows and self.transfer.staged:  # read on the host, placed on the device once
            self.resident = reader.read(layer, torch.arange(resident_rows)).data.to(device)
        elif resident_rows:  # straight into the transfer's memory (flashllm_ext.mlx's: an mx.array)
            self.resident = reader.read(
                layer,
                torch.arange(resident_rows),
                self.transfer.empty((resident_rows, store.row_width), store.row_dtype),
            ).data
        self.resident_bias = None if bias is None else bias[:resident_rows].to(device)
        self.streamed_ids = torch.arange(resident_rows, n)
        self.streamed_bias = None if bias is None else bias[resident_rows:].to(device)
        out_bias = output_bias(store, layer)
        self.register_buffer("out_bias", None if out_bias is None else out_bias.to(device), persistent=False)
        self.nbytes = self.bytes_for(store, resident_rows)
        # (rows, rows used, their input bias or None) of every neuron: the resident bundles, the streamed ones
        self.parts = [] if self.resident is None else [(self.resident, resident_rows, self.resident_bias)]
        if n - resident_rows:
            self.parts.append((self.staging, n - resident_rows, self.streamed_bias))

    @staticmethod
    def bytes_for(store: FlashStore, resident_rows: int) -> int:
        """DRAM one layer holds on its own (the shared staging buffer is counted once by its owner): resident
        bundles, the ids of the streamed ones, the input bias (if any) and a float32 output bias (counted always)."""
        n = store.n_neurons
        bias = store.dtype.itemsize * n if input_bias_role(store) in store.ffn_roles[0] else 0
        return resident_rows * store.row_bytes + 8 * (n - resident_rows) + bias + 4 * store.hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = check_ffn_input(x, self.store.hidden_size, self.staging.device)
        out = self._accumulate(as_kernel_input(flat, self.input_dtype))
        return as_ffn_output(out, x)

    def _accumulate(self, xs, out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, d] float32 += the FFN (output bias included) of the T tokens xs [T, d] (input_dtype), the
        streamed bundles read first; out None: the FFN in a new tensor (a decode token's few tensor ops each cost
        microseconds of framework time, beside ~100 us of row reads at 135M shapes). Returns out. xs is whatever
        `_compute` computes on (a torch tensor here, an mx.array in flashllm_ext.mlx); the reads and the stats are
        torch on the host either way."""
        n_streamed = self.streamed_ids.numel()
        if n_streamed:
            start = self.transfer.clock()
            if self.landing is not None:
                _, read = self.reader.read_range(*self.streamed_range, self.landing)
            elif self.transfer.staged:
                landing = self.transfer.staging((n_streamed, self.store.row_width), self.store.row_dtype)
                read = self.reader.read(self.layer, self.streamed_ids, landing).stats
                self.transfer.upload(landing, self.staging[:n_streamed])
            else:
                read = self.reader.read(self.layer, self.streamed_ids, self.staging[:n_streamed]).stats
            self.stats.io_s += self.transfer.clock() - start
            self.stats.bytes_read += read.bytes_read
            self.stats.bytes_requested += read.bytes_requested
            self.stats.decompress_s += read.decompress_s
            self.stats.n_reads += read.n_reads
            self.stats.inserted += n_streamed
            self.stats.steps += 1
        self.stats.needed += self.store.n_neurons
        start = self.transfer.clock()
        out = self._compute(xs, out)
        if self.out_bias is not None:
            out += self.out_bias
        self.stats.compute_s += self.transfer.clock() - start
        self.stats.tokens += out.shape[0]
        return out

    def _compute(self, xs: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """out [T, d] float32 += the FFN of xs [T, d] over every neuron, the streamed ones read already (out None:
        the FFN itself, float32). Returns out."""
        for rows, num_used, bias in self.parts:
            y = bundle_ffn(self.store, xs, rows, num_used=num_used, bias=bias, activation=self.activation)
            out = as_float32(y) if out is None else out.add_(y)
        return out
