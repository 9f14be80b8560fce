"""The README's generated parts that the round trip does not pin down: the compact tree and
FILES.txt's self-listing."""

from __future__ import annotations

from atlas_lightning.hub.readme import PublishedFile, compact_tree, human_bytes, render_files_txt


def test_numbered_step_folders_collapse_into_one_line():
    files = [PublishedFile(f"artifacts/r/train/step_{n}/{uid}.json", 100) for n in range(1, 6) for uid in "ab"]
    files.append(PublishedFile("artifacts/r/run.json", 7))
    lines = compact_tree(files)
    assert lines == [
        "artifacts/  (11 files, 1.0 KB)",
        "    r/  (11 files, 1.0 KB)",
        "        train/  (10 files, 1.0 KB)",
        "            step_N/  N = 1..5 (5 folders; 10 files, 1.0 KB)",
        "        run.json  (7 B)",
    ]


def test_many_files_in_one_folder_are_summarised_by_suffix():
    files = [PublishedFile(f"a/{i}.json", 10) for i in range(7)] + [PublishedFile("a/t.npz", 30)]
    assert compact_tree(files)[-1] == "    8 files: 7 .json, 1 .npz (100 B)"


def test_files_txt_lists_itself_with_its_own_size():
    text = render_files_txt([PublishedFile("b.txt", 3), PublishedFile("a/x.json", 12345)])
    lines = text.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["FILES.txt", "a/x.json", "b.txt"]
    assert int(lines[0].split("\t")[1]) == len(text.encode())


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 999, 1000, 1_867_797_544)] == ["0 B", "999 B", "1.0 KB", "1.9 GB"]
