"""A tensor-parallel rank's GPU kernels, on one GPU: TP=2 and TP=4 with every rank on the same device.

NCCL refuses two ranks on one device, so the ranks' default group runs over gloo (which moves CUDA tensors
through the host) and decode runs eagerly; tests/gpu/test_multi_gpu.py covers NCCL and CUDA graphs on two GPUs.
What this file checks on any single GPU: the engine's rank-0 / worker machinery (``LeaderModel``,
``serve_steps``) driving the Triton MSA kernels and FlashInfer at a rank's head counts at M3 attention dims, in
bf16: TP=2 (32 query, 2 KV and 2 index heads per rank: the shape at which the decode index merge once faulted)
with tensor-parallel experts, TP=4 (16 query heads and a single KV and index head per rank, as at TP=8) with
expert parallelism.

Teacher-forced: the ranks replay TP=1's greedy continuation of a prompt longer than the MSA selection window.
Against a float32 single-GPU run on the plain-PyTorch attention (the same tokens), the parallel run's per-token
logit errors are distributed like TP=1's (median and 90th percentile within 1.5x + 5e-3), and its argmax is
TP=1's token at every step where TP=1's best two tokens are not within bf16 noise (0.05 in logprob).
"""

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from m3stack.engine.assembly.choices import make_attention_backend
from m3stack.engine.assembly.config import EngineConfig
from m3stack.engine.assembly.parallel import start_rank
from m3stack.engine.distributed.config import ParallelConfig
from m3stack.engine.distributed.leader import LeaderModel
from m3stack.engine.distributed.processes import free_port, leave_process_group
from m3stack.engine.distributed.recording import RecordingBackend
from m3stack.engine.distributed.worker import serve_steps
from m3stack.engine.kv_cache.tensors import allocate_kv_cache
from m3stack.engine.model.loader import load_model
from tests.engine.model.hf_oracle import token_errors
from tests.engine.model.paged_runner import Chunk, PagedRunner, Sequence

NUM_PAGES = 64  # of 128 tokens: the prompt and its continuation need 26
PROMPT_TOKENS = 3000  # past 16 selected blocks + the local block: MSA selects
PREFILL_CHUNK = 1024
NUM_TOKENS = 24
NEAR_TIE = 0.05
# M3's attention (64 query, 4 KV and 4 index heads of 128) on a narrow model: the per-rank shapes are the point.
VOCAB = 32768
NARROW = {"vocab_size": VOCAB, "hidden_size": 1024, "dense_intermediate_size": 2048, "intermediate_size": 512,
          "shared_intermediate_size": 512}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from bench.engine_step import model_config
    from bench.multi_gpu import write_checkpoint

    config = model_config(2, moe=True)
    config["text_config"].update(NARROW)
    config.update(image_token_index=VOCAB - 2, video_token_index=VOCAB - 1)
    return write_checkpoint(tmp_path_factory.mktemp("m3-attention-narrow"), config)


def _gpu_backend(caches, model_config):
    return make_attention_backend(caches, model_config, torch.device("cuda:0"), mode="msa")


def _worker(config: EngineConfig, rank: int) -> None:
    """A worker rank, on the same GPU as rank 0 (local rank 0), over gloo."""
    state = start_rank(config, rank, 0, collectives="gloo")
    caches = allocate_kv_cache(state.model.kv_cache_spec(), NUM_PAGES, state.device)
    serve_steps(state.model, _gpu_backend(caches, state.model.local_config()), state.channel)
    dist.destroy_process_group()


def _decode(runner: PagedRunner, prompt: torch.Tensor, forced: list[int] | None) -> tuple[torch.Tensor, list[int]]:
    """Prompt logits and ``NUM_TOKENS`` decode-step logits ``[n + NUM_TOKENS - 1, V]`` (float32), and the tokens:
    each step's argmax, or ``forced``'s tokens fed instead."""
    sequence = Sequence()
    with torch.inference_mode():
        rows = [runner.prefill(Chunk(sequence, prompt), PREFILL_CHUNK).float()]
        tokens = [int(rows[0][-1].argmax())] if forced is None else [forced[0]]
        while len(tokens) < NUM_TOKENS:
            step = runner.step([Chunk(sequence, torch.tensor([tokens[-1]]))]).float()
            rows.append(step)
            tokens.append(int(step[-1].argmax()) if forced is None else forced[len(tokens)])
    return torch.cat(rows), tokens


@pytest.mark.parametrize(
    ("ranks", "expert_parallel"), [(2, False), (4, True)], ids=["2-tensor-parallel-experts", "4-expert-parallel"]
)
def test_ranks_on_one_gpu_follow_one_rank(checkpoint, ranks, expert_parallel):
    prompt = torch.randint(0, VOCAB - 2, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(4))
    single, m3 = load_model(checkpoint, "cuda:0", torch.bfloat16)
    one_rank = PagedRunner(single, NUM_PAGES, "cuda:0", backend_factory=lambda caches: _gpu_backend(caches, m3))
    logits1, tokens = _decode(one_rank, prompt, forced=None)
    del single, one_rank
    exact, _ = load_model(checkpoint, "cuda:0", torch.float32)
    reference, _ = _decode(PagedRunner(exact, NUM_PAGES, "cuda:0"), prompt, forced=tokens)
    del exact
    torch.cuda.empty_cache()

    parallel = ParallelConfig(tensor_parallel=ranks, expert_parallel=expert_parallel, master_port=free_port())
    config = EngineConfig(model=str(checkpoint), device="cuda", dtype="bfloat16", num_kv_blocks=NUM_PAGES - 1,
                          parallel=parallel)  # fmt: skip
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_worker, args=(config, rank), daemon=True) for rank in range(1, ranks)]
    for worker in workers:
        worker.start()
    state = start_rank(config, 0, 0, collectives="gloo")
    leader = LeaderModel(state.model, state.channel)
    local = state.model.local_config()
    try:
        recorded = lambda caches: RecordingBackend(_gpu_backend(caches, local))  # noqa: E731
        parallel_run = PagedRunner(leader, NUM_PAGES, "cuda:0", backend_factory=recorded)
        logits2, _ = _decode(parallel_run, prompt, forced=tokens)
    finally:
        leader.stop_workers()
        leave_process_group(60)
        for worker in workers:
            worker.join(60)
    assert [worker.exitcode for worker in workers] == [0] * (ranks - 1)

    errors1, errors2 = token_errors(logits1, reference), token_errors(logits2, reference)
    for quantile in (0.5, 0.9):
        assert torch.quantile(errors2, quantile) <= 1.5 * torch.quantile(errors1, quantile) + 5e-3, (
            quantile, torch.quantile(errors1, quantile), torch.quantile(errors2, quantile))  # fmt: skip
    steps1, steps2 = logits1[-NUM_TOKENS:], logits2[-NUM_TOKENS:]
    top2 = torch.log_softmax(steps1, dim=-1).topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= NEAR_TIE
    picks = steps2.argmax(dim=-1).cpu()
    wrong = [i for i in range(NUM_TOKENS) if clear[i] and int(picks[i]) != tokens[i]]
    assert not wrong, (wrong, [(int(picks[i]), tokens[i]) for i in wrong])
