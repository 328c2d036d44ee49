"""The handles a Buffer hands out: DeepEP's tuples, carrying what epcomm's combine and cached dispatch need."""
import torch


class HtState:
    """What an HT handle carries besides DeepEP's tensors: the C handle with the layout, and the shapes."""

    def __init__(self, c_handle, num_tokens: int, topk: int, num_experts: int, num_recv: int, num_worst: int,
                 hidden: int):
        self.c_handle = c_handle
        self.num_tokens = num_tokens
        self.topk = topk
        self.num_experts = num_experts
        self.num_recv = num_recv      # exact mode: received rows; worst-token mode: -1 (device-side count only)
        self.num_worst = num_worst
        self.hidden = hidden          # the dispatch's: get_combine_buffer's default


class HtHandle(tuple):
    """DeepEP's intranode handle: (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    recv_src_idx, is_token_in_rank, send_head). rank_prefix_matrix and is_token_in_rank are filled (the former
    in exact mode); the channel matrices and send_head do not exist in epcomm and are None; .state holds the
    C layout that combine and cached dispatch use."""

    def __new__(cls, items, state: HtState):
        self = super().__new__(cls, items)
        self.state = state
        return self


class LowLatencyHandle(tuple):
    """DeepEP's LL handle: (recv_src_info, recv_layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts), recv_layout_range encoded as DeepEP's ((begin << 32) | count per source rank); plus what
    epcomm's combine needs: .recv_count, .c_layout_range (the C API's (count << 32) | begin) and .combine_args
    (the C API's combine arguments over this layout, filled once per set of dispatch outputs)."""

    def __new__(cls, items, recv_count: torch.Tensor, c_layout_range: torch.Tensor, combine_args=None):
        self = super().__new__(cls, items)
        self.recv_count = recv_count
        self.c_layout_range = c_layout_range
        self.combine_args = combine_args
        return self
