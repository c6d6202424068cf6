"""What the engine writes into its cache is as readable as the umask allows, whoever wrote it privately."""
import os

from engine.models.cache_files import make_shareable, umask


def test_the_umask_is_read_without_being_set_and_private_files_become_shareable(tmp_path):
    previous = os.umask(0o027)
    try:
        assert umask() == 0o027 and os.umask(0o027) == 0o027  # read, and left as it was
        nested = tmp_path / "checkpoint" / "sub"
        nested.mkdir(parents=True)
        files = [tmp_path / "checkpoint" / "model.safetensors", nested / "config.json"]
        for file in files:
            file.write_text("x")
            file.chmod(0o600)
        make_shareable(tmp_path / "checkpoint")
        assert {f.stat().st_mode & 0o777 for f in files} == {0o640}
        single = tmp_path / "kept.safetensors"
        single.write_text("x")
        single.chmod(0o600)
        make_shareable(single)
        assert single.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(previous)
