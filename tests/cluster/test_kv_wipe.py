"""`pdserve kv-wipe`: a disk tier's blocks deleted offline, one worker's slot or all of them."""

from __future__ import annotations

from pdserve.cluster.cli import main


def test_kv_wipe_deletes_one_slot_or_every_slot(tmp_path, capsys):
    for slot in ("prefill-0", "decode-0"):
        (tmp_path / slot).mkdir()
        (tmp_path / slot / "00000000000000aa.kv").write_bytes(b"x")
    assert main(["kv-wipe", "--kv-disk-dir", str(tmp_path), "--slot", "prefill-0"]) == 0
    assert not (tmp_path / "prefill-0").exists() and (tmp_path / "decode-0").exists()
    assert main(["kv-wipe", "--kv-disk-dir", str(tmp_path)]) == 0
    assert not any(tmp_path.iterdir())
    assert main(["kv-wipe", "--kv-disk-dir", str(tmp_path), "--slot", ".."]) == 2
    assert "plain folder name" in capsys.readouterr().err
