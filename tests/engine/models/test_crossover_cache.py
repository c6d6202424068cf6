"""The GGUF block/dense crossover is timed once per CPU and set-up, then read back; anything it depends on that
changes, or a file that does not read, times it again."""
from types import SimpleNamespace

import torch

from engine.models import crossover_cache
from engine.models.cache_files import umask


def fake_linears(rows: int = 64) -> list:
    return [SimpleNamespace(blocks=SimpleNamespace(kind="q4"), in_features=128, out_features=rows)]


def counting_timer(monkeypatch, answer: int) -> list:
    calls = []
    monkeypatch.setattr(crossover_cache, "crossover_rows", lambda linears, dtype: calls.append(dtype) or answer)
    return calls


def test_a_measured_crossover_is_kept_and_read_back_until_what_it_depends_on_changes(tmp_path, monkeypatch):
    calls = counting_timer(monkeypatch, 24)
    assert crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, tmp_path) == 24
    assert crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, tmp_path) == 24
    assert len(calls) == 1
    crossover_cache.kept_crossover_rows(fake_linears(), torch.bfloat16, tmp_path)  # another dtype
    crossover_cache.kept_crossover_rows(fake_linears(rows=96), torch.float32, tmp_path)  # other matrices
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)  # another thread count
        crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 4
    kept = list((tmp_path / "gguf-crossover").glob("*.json"))
    assert len(kept) == 4
    assert {f.stat().st_mode & 0o777 for f in kept} == {0o666 & ~umask()}  # as the umask allows, for a shared cache


def test_a_kept_file_that_does_not_read_is_timed_again_and_without_a_cache_every_load_times_it(tmp_path, monkeypatch):
    calls = counting_timer(monkeypatch, 12)
    crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, tmp_path)
    [kept] = (tmp_path / "gguf-crossover").glob("*.json")
    kept.write_text('{"rows": ')  # a torn write from elsewhere
    assert crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, tmp_path) == 12
    assert len(calls) == 2
    assert crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, tmp_path) == 12
    assert len(calls) == 2  # the second timing rewrote it whole
    kept.write_text('{"rows": "twelve"}')  # reads, but holds no number: timed again and rewritten
    assert crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, tmp_path) == 12
    assert crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, tmp_path) == 12
    assert len(calls) == 3
    crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, None)
    crossover_cache.kept_crossover_rows(fake_linears(), torch.float32, None)
    assert len(calls) == 5
    assert not list((tmp_path / "gguf-crossover").glob(".keep-*"))  # no staging file left behind
