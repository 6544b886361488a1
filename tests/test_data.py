"""Corpora, tokenizers and the dp-sharded sampler."""

import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import framework.data as data_mod
import framework.data.build as build_mod
import framework.data.cache as cache_mod
from framework.data import BYTES_EOS, ShardedSampler, TokenData, lock_path, meta_path, prepare, stdlib_files

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


# ---- the checked token cache ----

def _pycode(cache, *more):
    return compose("data=pycode", "data.max_files=3", f"data.cache_dir={cache}", "trainer.micro_batch_size=1",
                   "schedule.microbatches=1", *more)


def _sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def built(tmp_path, capsys):
    """A fresh pycode cache in tmp_path: (run, .npy path, its tokens, its bytes)."""
    run = _pycode(tmp_path)
    path = Path(prepare(run).tokens_path)
    capsys.readouterr()
    return run, path, np.load(path).copy(), path.read_bytes()


def _rebuilt(run, path, tokens, raw, capsys) -> str:
    """prepare() rebuilt the cache to the same bytes; returns the one warning line it printed."""
    p = prepare(run)
    err = [line for line in capsys.readouterr().err.splitlines() if "token cache" in line]  # not datasets' bars
    assert p.tokens_path == str(path) and len(err) == 1, err
    assert path.read_bytes() == raw and np.array_equal(np.load(path), tokens)
    meta = json.loads(meta_path(path).read_text())
    assert meta["sha256"] == _sha(path) and meta["bytes"] == len(raw) and meta["num_tokens"] == len(tokens)
    return err[0]


def test_cache_metadata_records_what_the_pycode_cache_was_built_from(built):
    run, path, tokens, raw = built
    meta = json.loads(meta_path(path).read_text())
    files = stdlib_files(3)
    assert meta["inputs"] == {"format": data_mod.CACHE_FORMAT, "name": "pycode", "tokenizer": "bytes",
                              "vocab_size": 257, "dtype": "uint16",
                              "sources": {"stdlib": [[f, os.path.getsize(f)] for f in files]}}
    assert meta["num_tokens"] == len(tokens) and tokens.dtype == np.uint16
    assert meta["bytes"] == len(raw) == path.stat().st_size
    assert meta["sha256"] == hashlib.sha256(raw).hexdigest()
    assert meta["info"] == {"built_with_seq_len": run.data.seq_len}
    assert lock_path(path).exists() and sorted(q.name for q in path.parent.glob("pycode-*")) == \
        sorted([path.name, meta_path(path).name, lock_path(path).name])  # no temporaries left


def test_cache_metadata_records_the_hf_sources(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"document {i}"}) for i in range(40)))
    run = compose("data=hf", "data.path=json", f"data.data_files={path}", "data.text_field=body",
                  "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=8",
                  "trainer.micro_batch_size=1", "schedule.microbatches=1")
    tokens_path = Path(prepare(run).tokens_path)
    meta = json.loads(meta_path(tokens_path).read_text())
    stat = path.stat()
    assert meta["inputs"]["sources"] == {"path": "json", "data_files": str(path), "split": "train",
                                         "text_field": "body",
                                         "local_files": [[str(path), stat.st_size, stat.st_mtime]]}
    assert meta["num_tokens"] == sum(len(f"document {i}") + 1 for i in range(40))
    path.write_text(path.read_text() + "\n" + json.dumps({"body": "one more"}))  # edited in place
    assert Path(prepare(run).tokens_path) == tokens_path
    assert json.loads(meta_path(tokens_path).read_text())["num_tokens"] == meta["num_tokens"] + len("one more") + 1


def test_a_truncated_cache_is_named_and_rebuilt(built, capsys):
    run, path, tokens, raw = built
    path.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ValueError, match="mmap length is greater than file size"):
        np.load(path, mmap_mode="r")  # what every run met before the check
    assert _rebuilt(run, path, tokens, raw, capsys) == \
        f"warning: token cache {path} is truncated ({len(raw) // 2} of {len(raw)} bytes); rebuilding"


def test_bytes_overwritten_in_range_fail_the_checksum_and_rebuild(built, capsys):
    run, path, tokens, raw = built
    bad = tokens.copy()
    bad[100:110] = (bad[100:110] + 1) % 256  # still valid byte tokens: would train silently
    header = len(raw) - tokens.nbytes
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.seek(header)
        f.write(bad.tobytes())
    assert path.stat().st_size == len(raw) and np.array_equal(np.load(path), bad)
    assert _rebuilt(run, path, tokens, raw, capsys) == (
        f"warning: token cache {path} does not match its sha256 checksum "
        "(its bytes changed after it was built); rebuilding")


@pytest.mark.parametrize("damage,reason", [
    (None, "has no metadata file {meta} (an older version's cache, or an interrupted build)"),
    ("{not json", "has an unreadable metadata file {meta} ("),
    ('{"inputs": 1, "bytes": 3}', "has an invalid metadata file {meta} (missing or mistyped: inputs, num_tokens, sha256)"),
    ("vocab_size", "was built from other inputs (changed: vocab_size)"),
], ids=["missing", "not-json", "mistyped", "other-inputs"])
def test_missing_garbage_or_stale_metadata_rebuilds(built, capsys, damage, reason):
    run, path, tokens, raw = built
    m = meta_path(path)
    if damage is None:
        m.unlink()
    elif damage == "vocab_size":  # a well-formed record of other build inputs
        meta = json.loads(m.read_text())
        meta["inputs"]["vocab_size"] = 50257
        m.write_text(json.dumps(meta))
    else:
        m.write_text(damage)
    warning = _rebuilt(run, path, tokens, raw, capsys)
    assert warning.startswith(f"warning: token cache {path} " + reason.format(meta=m.name)), warning
    assert warning.endswith("; rebuilding")


def test_a_valid_cache_is_not_rebuilt_for_any_seq_len(built, capsys):
    run, path, tokens, raw = built
    before = [(q.stat().st_ino, q.stat().st_mtime_ns) for q in (path, meta_path(path))]
    for seq_len in (run.data.seq_len, 16):  # seq_len cuts the stream at load time: not a build input
        p = prepare(_pycode(path.parent, f"data.seq_len={seq_len}"))
        assert p.tokens_path == str(path) and p.num_samples == (len(tokens) - 1) // seq_len
    assert "token cache" not in capsys.readouterr().err
    assert [(q.stat().st_ino, q.stat().st_mtime_ns) for q in (path, meta_path(path))] == before


def test_a_missing_cache_is_built_without_a_warning(tmp_path, capsys):
    p = prepare(_pycode(tmp_path))
    assert Path(p.tokens_path).exists() and "token cache" not in capsys.readouterr().err


def test_token_data_names_a_cache_damaged_after_prepare(built):
    run, path, tokens, raw = built
    path.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(RuntimeError, match=f"token cache {path} cannot be loaded .*rerun to rebuild it"):
        TokenData.load(run, str(path))


def _prepare_in_child(run, barrier, results):
    barrier.wait()  # both builders start on the empty cache dir together
    p = prepare(run)
    results.put((p.tokens_path, p.num_samples, _sha(p.tokens_path)))


def test_two_concurrent_builders_end_with_one_valid_cache(tmp_path, capfd):
    ctx = multiprocessing.get_context("fork")  # children inherit the imports: fast
    barrier, results = ctx.Barrier(2), ctx.Queue()
    run = _pycode(tmp_path)
    procs = [ctx.Process(target=_prepare_in_child, args=(run, barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    got = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert got[0] == got[1]
    path = Path(got[0][0])
    meta = json.loads(meta_path(path).read_text())
    assert meta["sha256"] == got[0][2] == _sha(path) and meta["num_tokens"] == len(np.load(path, mmap_mode="r"))
    assert "token cache" not in capfd.readouterr().err  # the second found the first's cache complete
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_waiting_builder_rechecks_under_the_lock_and_uses_the_other_jobs_cache(built, tmp_path, monkeypatch):
    """Job B finds no cache while job A holds the lock (A is building); once A is done, B
    must take A's cache instead of building again."""
    run, built_path, tokens, raw = built
    other = tmp_path / "other"
    other.mkdir()
    path = other / built_path.name  # the key does not depend on cache_dir
    seen, first_check = [], threading.Event()

    def verify(*a):
        result = real_verify(*a)
        seen.append(result[1])
        first_check.set()
        return result

    real_verify = cache_mod._verify
    monkeypatch.setattr(cache_mod, "_verify", verify)
    monkeypatch.setattr(data_mod, "build_cache", lambda *a: pytest.fail("built again"))
    out = {}
    with open(lock_path(path), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # job A (readers may share, B's exclusive lock must wait)
        job_b = threading.Thread(target=lambda: out.update(p=prepare(_pycode(other))))
        job_b.start()
        assert first_check.wait(60)
        time.sleep(0.3)
        assert job_b.is_alive() and seen == ["does not exist"]  # B waits for the exclusive lock
        shutil.copy(built_path, path)  # A finishes: tokens, then metadata
        shutil.copy(meta_path(built_path), meta_path(path))
        fcntl.flock(lock, fcntl.LOCK_UN)
    job_b.join(60)
    assert seen == ["does not exist", None] and out["p"].tokens_path == str(path)
    assert path.read_bytes() == raw


# ---- data that scales: streamed builds, parallel tokenization, the cheap start-up check ----

def _hf_run(data_file, cache, tokenizer="bytes", field="text"):
    return compose("data=hf", "data.path=json", f"data.data_files={data_file}", f"data.text_field={field}",
                   f"data.tokenizer={tokenizer}", f"data.cache_dir={cache}", "data.seq_len=64",
                   "trainer.micro_batch_size=1", "schedule.microbatches=1")


def test_a_large_corpus_is_built_and_loaded_without_holding_it_as_python_objects(tmp_path, monkeypatch):
    texts = [f"document {i:06d} " + "lorem ipsum dolor sit amet " * 3 for i in range(40_000)]  # ~3.9M tokens
    corpus = tmp_path / "big.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    as_list = sys.getsizeof(texts) + sum(sys.getsizeof(t) for t in texts)  # what the corpus costs as a list
    want = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), BYTES_EOS) for t in texts])
    del texts
    run = _hf_run(corpus, tmp_path / "cache")
    path = Path(prepare(run).tokens_path)  # also converts the json into datasets' Arrow cache (datasets' work)
    path.unlink()
    monkeypatch.setattr(build_mod, "CHUNK_BYTES", 1 << 15)
    tracemalloc.start()
    try:
        p = prepare(run)  # rebuilds the tokens from the Arrow cache
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < as_list / 4, (peak, as_list)  # ~0.7 MB against ~6.4 MB (and ~16 MB of int32 tokens before)
    data = TokenData.load(run, p.tokens_path)
    assert isinstance(data.tokens, np.memmap) and np.array_equal(data.tokens, want)
    np.save(tmp_path / "ref.npy", want.astype(np.uint16))
    assert path.read_bytes() == (tmp_path / "ref.npy").read_bytes()  # streamed, yet the file np.save writes


def test_parallel_tokenization_writes_the_single_process_bytes(tmp_path, monkeypatch, capsys):
    texts = [f"Paragraph {i}: stage {i % 7} sends micro-batch {i % 5} to stage {i % 7 + 1}. " * (1 + i % 4)
             for i in range(400)]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    _local_tokenizer(texts, tmp_path / "tok")
    monkeypatch.setattr(build_mod, "CHUNK_BYTES", 2048)  # many chunks, so the order matters
    built = {}
    for processes in (1, 2):
        monkeypatch.setattr(build_mod, "tokenizer_processes", lambda text_bytes, n=processes: n)
        run = _hf_run(corpus, tmp_path / f"cache{processes}", tokenizer=tmp_path / "tok")
        built[processes] = Path(prepare(run).tokens_path).read_bytes()
    assert built[1] == built[2]
    err = capsys.readouterr().err
    assert "2 processes" in err and "documents" in err  # a parallel build announces itself


def test_the_pool_tokenizes_in_other_processes_in_order_and_reports_progress(tmp_path, monkeypatch, capsys):
    seen = tmp_path / "pids"
    real_encode = build_mod.encode

    def encode(tok, texts, dtype):
        with open(seen, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real_encode(tok, texts, dtype)

    monkeypatch.setattr(build_mod, "encode", encode)
    monkeypatch.setattr(build_mod, "PROGRESS_INTERVAL_S", 0.0)
    tok = data_mod.ByteTokenizer()
    chunks = [[f"doc {i}.{j}" for j in range(i % 3 + 1)] for i in range(30)]
    got = list(build_mod.encoded_chunks(iter(chunks), tok, np.dtype(np.uint16), processes=2))
    workers = set(seen.read_text().split())
    assert workers and str(os.getpid()) not in workers  # every chunk was tokenized by a pool worker
    assert [n for n, _ in got] == [len(c) for c in chunks]
    assert [a.tolist() for _, a in got] == [real_encode(tok, c, np.dtype(np.uint16)).tolist() for c in chunks]
    assert build_mod.tokenizer_processes(build_mod.PARALLEL_MIN_BYTES - 1) == 1  # a small corpus: no pool
    # progress: with the interval at 0 every chunk prints a line, then a last one
    run = _pycode(tmp_path / "cache")
    prepare(run)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenizing ")]
    assert len(lines) >= 2 and ": 3 of 3 documents (100%)" in lines[-2] and ": done: 3 documents" in lines[-1]


def _spy_full_hash(monkeypatch) -> list:
    """Record which files get the full sha256 (the build hashes its temporary, `.tmp<pid>.npy`)."""
    calls, real = [], cache_mod.sha256
    monkeypatch.setattr(cache_mod, "sha256", lambda p: calls.append(Path(p)) or real(p))
    return calls


def test_an_unchanged_cache_is_not_hashed_whole_at_start(built, monkeypatch, capsys):
    run, path, tokens, raw = built
    calls = _spy_full_hash(monkeypatch)
    sampled, real_sampled = [], cache_mod.sampled_sha256
    monkeypatch.setattr(cache_mod, "sampled_sha256", lambda *a: sampled.append(a) or real_sampled(*a))
    assert prepare(run).tokens_path == str(path)
    assert calls == [] and len(sampled) == 1 and "token cache" not in capsys.readouterr().err


def test_a_moved_mtime_gets_the_full_hash_once_and_is_recorded(built, monkeypatch, capsys):
    run, path, tokens, raw = built
    calls = _spy_full_hash(monkeypatch)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, or copied without its times
    assert prepare(run).tokens_path == str(path) and calls == [path]  # same bytes: kept, not rebuilt
    assert json.loads(meta_path(path).read_text())["mtime_ns"] == st.st_mtime_ns + 10**9
    prepare(run)
    assert calls == [path] and "token cache" not in capsys.readouterr().err  # the next start is cheap again
    assert path.read_bytes() == raw


def test_bytes_overwritten_with_the_mtime_set_back_fail_the_sampled_check(built, monkeypatch, capsys):
    run, path, tokens, raw = built
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(len(raw) - 20)
        f.write(bytes(b ^ 1 for b in raw[-20:]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as recorded
    calls = _spy_full_hash(monkeypatch)
    assert _rebuilt(run, path, tokens, raw, capsys) == (
        f"warning: token cache {path} does not match its sha256 checksum "
        "(its bytes changed after it was built); rebuilding")
    assert path not in calls  # found by the sampled checksum; the full hash ran on the rebuild's temporary only


def test_the_sampled_checksum_reads_spread_blocks_of_a_large_file():
    B, K = cache_mod.SAMPLED_BLOCK_BYTES, cache_mod.SAMPLED_BLOCKS
    assert cache_mod.sampled_offsets(K * B) == [0]  # read whole
    size = 10**9 + 7
    offsets = cache_mod.sampled_offsets(size)
    assert len(offsets) == K and offsets[0] == 0 and offsets[-1] == size - B
    assert all(b - a > B for a, b in zip(offsets, offsets[1:]))
