"""epcomm.Config: DeepEP's performance-tuning config. epcomm's engines size their own queues, so the values are
kept for API compatibility (and num_sms is honoured as the GPU engine's SM budget by Buffer) but not needed."""


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        if num_sms <= 0 or num_sms % 2 != 0:
            raise ValueError(f"Config: num_sms = {num_sms} must be a positive even number")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP's intranode buffer would take; epcomm allocates its own, so this is only a hint."""
        channels = self.num_sms // 2
        per_token = hidden_bytes + 4 * 32 + 8 * 32 + 4 * 128  # row + top-k + scales metadata, as DeepEP counts
        return num_ranks * num_ranks * channels * self.num_max_nvl_chunked_recv_tokens * per_token

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # intranode only: no RDMA buffer

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")
