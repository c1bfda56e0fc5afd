"""Object-store transfers report their progress off a terminal: lines with bytes, percent and ETA
as a folder goes up to a real SeaweedFS bucket and comes back down (fsspec's transfer callbacks)."""

import logging
import re
import time

from trainer.io import progress, storage

LINE = re.compile(r"(upload to|download) (\S+): ([\d.]+)/([\d.]+) MiB \((\d+)%\), \d+s, ETA \S+")


def test_upload_and_download_of_a_folder_report_bytes_and_eta(s3_env, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(storage, "PROGRESS_MIN_BYTES", 2**20)  # a 4 MiB folder counts as big here
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.bin", "b.bin", "sub/c.bin", "sub/d.bin"):
        (folder / name).write_bytes(b"x" * 2**20)
    (folder / "small.json").write_text("{}")  # a few bytes: below the threshold on its own, counted in the total
    uri = f"s3://{s3_env.bucket}/progress/{time.time_ns()}"

    with caplog.at_level(logging.INFO, logger="trainer.io.storage"):
        storage.upload_dir(folder, uri)
        local = storage.fetch_to_local(uri, tmp_path / "back")
    lines = [m.groups() for r in caplog.records if (m := LINE.fullmatch(r.getMessage()))]
    ups = [g for g in lines if g[0] == "upload to"]
    downs = [g for g in lines if g[0] == "download"]
    # A line at each further 25 % (1 MiB files: 1 MiB of 4 MiB + 2 bytes is just under 25 %), the whole at the end.
    assert [int(g[4]) for g in ups] == [50, 75, 100], ups
    assert ups[-1][2:4] == ("4.0", "4.0")
    percents = [int(g[4]) for g in downs]
    assert len(downs) >= 2 and percents == sorted(percents) and downs[-1][2:5] == ("4.0", "4.0", "100"), downs
    assert (tmp_path / "back" / "sub" / "d.bin").read_bytes() == b"x" * 2**20 and local == str(tmp_path / "back")

    caplog.clear()  # below the threshold: no lines at all
    monkeypatch.setattr(storage, "PROGRESS_MIN_BYTES", 64 * 2**20)
    with caplog.at_level(logging.INFO, logger="trainer.io.storage"):
        storage.upload_dir(folder, uri + "-again")
    assert not [r for r in caplog.records if LINE.fullmatch(r.getMessage())]
    assert progress.PERCENT_STEP == 25  # what the first assertion's percentages rest on
