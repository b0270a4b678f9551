"""scripts/train_embedded.py's data hand-off (--write-data / --data) and --init-from's guard,
on a tokenizer trained on a few lines (no stdlib corpus, no training)."""

import json
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import train_embedded  # noqa: E402

TEXTS = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "import os\nprint(os.sep)\n"] * 4


@pytest.fixture(scope="module")
def tok():
    return train_embedded.train_tokenizer(TEXTS, vocab_size=300)


def test_written_data_loads_back_unchanged(tok, tmp_path):
    train_ids = train_embedded.encode_stream(tok, TEXTS[:2], 0)
    val_ids = train_embedded.encode_stream(tok, TEXTS[2:3], 0)
    corpus = {"python": "3.11.7", "train_tokens": len(train_ids), "val_tokens": len(val_ids), "sha256": "x"}
    train_embedded.write_data(tmp_path, tok, train_ids, val_ids, corpus)
    tok2, train2, val2, corpus2 = train_embedded.load_data(tmp_path)
    assert train2.dtype == np.uint16 and val2.dtype == np.uint16
    np.testing.assert_array_equal(train2, train_ids)
    np.testing.assert_array_equal(val2, val_ids)
    assert corpus2 == corpus
    for text in TEXTS[:3]:
        assert tok2.encode(text).ids == tok.encode(text).ids
    # The stream is <eot> doc <eot> doc <eot>, decoding back to the texts.
    assert train_ids[0] == 0 and train_ids[-1] == 0
    assert tok.decode(train_ids.tolist(), skip_special_tokens=True) == "".join(TEXTS[:2])


def test_incomplete_or_inconsistent_data_is_refused(tok, tmp_path):
    ids = train_embedded.encode_stream(tok, TEXTS[:1], 0)
    train_embedded.write_data(tmp_path, tok, ids, ids, {"python": "3", "train_tokens": len(ids), "val_tokens": len(ids)})
    record = json.loads((tmp_path / "corpus.json").read_text())
    record["train_tokens"] += 1
    (tmp_path / "corpus.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="do not have the lengths corpus.json records"):
        train_embedded.load_data(tmp_path)
    (tmp_path / "val_ids.npy").unlink()
    with pytest.raises(SystemExit, match="missing val_ids.npy; write it with --write-data"):
        train_embedded.load_data(tmp_path)


def test_init_from_refuses_a_model_with_another_tokenizer(tok, tmp_path):
    (tmp_path / "tokenizer.json").write_text(tok.to_str(pretty=True).replace("return", "retrun"))
    args = Namespace(init_from=str(tmp_path), docs=str(tmp_path))
    with pytest.raises(SystemExit, match="differs from the tokenizer trained on this corpus"):
        train_embedded.load_init(args, tok, 0)
