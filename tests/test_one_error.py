"""One error on the screen (issue 36): a user error that one rank finds alone, and what its peers say.

Rank 0 alone prepares the data (one process per node does), so a mistake in the files is found by
rank 0 while rank 1 waits for it in a collective. Rank 1 then loses its connection: it used to print
gloo's "Connection closed by peer" traceback (33 lines) before rank 0's one-line error. Now rank 0
says its error before it leaves the process group, and the peer that lost it ends quietly: nothing
under nodescale's launcher (it prints the error, naming the rank), one line under torchrun.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from PIL import Image

from conftest import cli_env, run_cli

TRAIN = ["train", "--nproc", "2", "--max-steps", "1", "--no-progress"]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three data sets, each with one mistake that only their preparation (rank 0's) finds."""
    root = tmp_path_factory.mktemp("broken")
    for name in ("cat", "dog"):  # and an empty class folder
        (root / "images" / name).mkdir(parents=True)
        for number in range(4):
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "images" / name / f"{number}.png")
    (root / "images" / "eel").mkdir()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"</s>": 0, "a": 1, "b": 2}, unk_token="</s>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "docs.jsonl").write_text('{"text": "a b a b"}\n' * 40 + '{"text": "a b",\n')  # the last line broken
    (root / "shards").mkdir()
    with tarfile.open(root / "shards" / "train-000000.tar", "w") as tar:
        for key in range(6):
            array = io.BytesIO()
            np.save(array, np.zeros((1, 8, 8), np.uint8))
            _add(tar, f"k{key}.npy", array.getvalue())
            _add(tar, f"k{key}.json", json.dumps({"kind": 1} if key == 4 else {"cls": key % 2}).encode())
    return root


# name: (flags, the error's first line after "nodescale: error (rank 0): ", with ROOT for the data's directory)
CASES = {
    "empty_class_folder": (["--dataset", "imagefolder", "--data-dir", "images"],
                           "class directory ROOT/images/eel: holds no images"),
    "broken_jsonl_line": (["--dataset", "jsonl", "--data-dir", "docs.jsonl", "--set", "data.tokenizer=tokenizer.json",
                           "--model", "gpt_nano"], "ROOT/docs.jsonl:41: is not a JSON object"),
    "shard_label_without_cls": (["--dataset", "shards", "--data-dir", "shards"],
                                "shard ROOT/shards/train-000000.tar, sample k4: has an unreadable label in k4.json "
                                "(no integer 'cls' or 'label' field)"),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_a_data_error_rank_0_finds_alone_is_all_the_screen_shows(broken: Path, case: str) -> None:
    flags, error = CASES[case]
    result = run_cli([*TRAIN, *flags, "--out", f"run-{case}"], cwd=broken, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[1].startswith("  hint: "), result.stderr  # nothing from rank 1
    assert lines[0].startswith(f"nodescale: error (rank 0): {error.replace('ROOT', str(broken))}"), result.stderr


@pytest.mark.multiproc
def test_under_torchrun_the_peer_of_a_rank_with_a_user_error_says_one_line(broken: Path) -> None:
    """No launcher of nodescale's to print the error: rank 0 prints it before leaving the group (torchrun ends
    the other ranks once one has exited), and rank 1 says in one line that it lost rank 0."""
    flags, error = CASES["empty_class_folder"]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--tee", "3",
         "-m", "nodescale", *TRAIN[:1], *TRAIN[3:], *flags, "--out", "run-torchrun"],
        cwd=broken, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    ranks = {rank: [line.split(":", 1)[1] for line in result.stdout.splitlines() + result.stderr.splitlines()
                    if line.startswith(f"[default{rank}]:")] for rank in (0, 1)}
    assert ranks[0][0] == f"nodescale: error (rank 0): {error.replace('ROOT', str(broken))}" + \
        " (png, jpg, jpeg, bmp, ppm, gif, webp)", ranks
    assert ranks[0][1].startswith("  hint: ") and len(ranks[0]) == 2, ranks
    assert len(ranks[1]) <= 1 and all("stopped at step 0: it lost its connection" in line for line in ranks[1]), ranks
