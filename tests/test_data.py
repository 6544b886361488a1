"""Corpora, tokenizers and the dp-sharded sampler."""

import json

import numpy as np
import pytest

from framework.data import BYTES_EOS, ShardedSampler, TokenData, prepare, stdlib_files

from .conftest import compose


def _epoch_positions(n, mbs, m, dp, steps, seed=0):
    """All indices each rank reads, in stream order: {rank: [idx...]}."""
    out = {}
    for r in range(dp):
        s = ShardedSampler(n, mbs, m, r, dp, seed)
        out[r] = [int(i) for step in range(steps) for mb in s.step_indices(step) for i in mb]
    return out


@pytest.mark.parametrize("n,mbs,m,dp", [(64, 2, 2, 2), (50, 2, 3, 4), (37, 1, 1, 4), (100, 4, 2, 1)])
def test_shards_are_disjoint_and_an_epoch_covers_every_sample_once(n, mbs, m, dp):
    G = mbs * m * dp
    steps = -(-3 * n // G)  # three epochs' worth
    per_rank = _epoch_positions(n, mbs, m, dp, steps)
    # Rebuild the global stream: step k = rank 0's slice, then rank 1's, ...
    L = mbs * m
    stream = [per_rank[r][k * L:(k + 1) * L] for k in range(steps) for r in range(dp)]
    stream = [i for chunk in stream for i in chunk]
    for e in range(3):  # within an epoch: nothing dropped, nothing repeated, across all ranks
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    for k in range(steps):  # within a step inside one epoch, ranks never share a sample
        if (k * G) // n != ((k + 1) * G - 1) // n:
            continue  # a step straddling two epochs may meet a sample once from each
        slices = [set(per_rank[r][k * L:(k + 1) * L]) for r in range(dp)]
        assert sum(len(s) for s in slices) == len(set().union(*slices))


def test_every_dp_layout_sees_the_single_process_batches():
    n, mbs, steps = 40, 2, 7
    single = ShardedSampler(n, mbs, 4, 0, 1, seed=3)
    for dp, m in ((2, 2), (4, 1)):
        ranks = [ShardedSampler(n, mbs, m, r, dp, seed=3) for r in range(dp)]
        for k in range(steps):
            ref = np.concatenate(single.step_indices(k))
            got = np.concatenate([np.concatenate(s.step_indices(k)) for s in ranks])
            assert np.array_equal(ref, got)


def test_order_is_fixed_by_the_seed():
    a = ShardedSampler(30, 2, 2, 0, 1, seed=1).stream(0, 30)
    assert np.array_equal(a, ShardedSampler(30, 2, 2, 0, 1, seed=1).stream(0, 30))
    assert not np.array_equal(a, ShardedSampler(30, 2, 2, 0, 1, seed=2).stream(0, 30))


def test_packed_samples_are_next_token_pairs():
    data = TokenData(np.arange(21), seq_len=5)
    assert data.num_samples == 4
    x, y = data.batch(np.array([2, 0]))
    assert x.tolist() == [[10, 11, 12, 13, 14], [0, 1, 2, 3, 4]]
    assert y.tolist() == [[11, 12, 13, 14, 15], [1, 2, 3, 4, 5]]


def test_pycode_reads_the_stdlib_with_the_byte_tokenizer(data_cache):
    run = compose("data=pycode", "data.max_files=3", f"data.cache_dir={data_cache}", "trainer.micro_batch_size=1",
                  "schedule.microbatches=1")
    p = prepare(run)
    tokens = np.load(p.tokens_path)
    files = stdlib_files(3)
    first = open(files[0], encoding="utf-8").read().encode()
    assert p.vocab_size == 257
    assert bytes(tokens[:len(first)].astype(np.uint8)) == first and tokens[len(first)] == BYTES_EOS
    assert (tokens == BYTES_EOS).sum() == sum(1 for f in files if open(f, encoding="utf-8").read())
    assert prepare(run).tokens_path == p.tokens_path  # cached


def _local_tokenizer(texts, path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


def make_local_hf_dataset(tmp_path):
    """A SQuAD-shaped JSON-lines file and a BPE tokenizer saved with save_pretrained."""
    texts = [f"Paragraph {i}: the pipeline has {i % 7 + 2} stages and {i % 5 + 1} micro-batches." * 3 for i in range(60)]
    path = tmp_path / "squad_like.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "context": t}) for i, t in enumerate(texts)))
    _local_tokenizer(texts, tmp_path / "tok")
    return texts, path, tmp_path / "tok"


def test_hf_loader_reads_a_local_file_with_a_local_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    texts, path, tok_dir = make_local_hf_dataset(tmp_path)
    run = compose("data=hf", "data.path=json", f"data.data_files={path}", "data.text_field=context",
                  f"data.tokenizer={tok_dir}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=16",
                  "trainer.micro_batch_size=1", "schedule.microbatches=1")
    p = prepare(run)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tokens = np.load(p.tokens_path).astype(np.int64)
    docs = tok.decode(tokens).split("<|endoftext|>")
    assert docs[:-1] == texts and p.vocab_size == len(tok)
    with pytest.raises(Exception, match="data.text_field='body'"):
        prepare(compose("data=hf", "data.path=json", f"data.data_files={path}", "data.text_field=body",
                        f"data.tokenizer={tok_dir}", f"data.cache_dir={tmp_path / 'cache2'}"))
