"""A row's fields are defined once (`relaytrain.schema.row.FIELDS`): a field added there reaches
the dataset, the loaders (in memory and streamed), the micro-batch and its moves, the rows that
fill an evaluation micro-batch and the tokenize cache, with none of those modules edited."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

from relaytrain.data import cache
from relaytrain.data.dataset import TokenDataset
from relaytrain.models.layered import MicroBatch
from relaytrain.schema import row

# Run in a fresh process: the definition gets two more fields (a preference pair's rejected ids,
# per token; a rollout's advantage, one float a row and read by the loss) before anything that
# holds rows is imported. Every row is made so that its fields agree (`agree`), so a field that
# is dropped, reordered, cast or mixed with another row's anywhere on the way is caught.
FLOW = textwrap.dedent('''
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from relaytrain.schema import row

    row.FIELDS = (*row.FIELDS,
                  row.Field("rejected_ids", "a preference pair's rejected reply", row.Per.TOKEN, optional=True),
                  row.Field("advantages", "a rollout's advantage", row.Per.ROW, dtype=torch.float32,
                            optional=True, pad=0.0, target=True))

    from relaytrain.data import cache, stream
    from relaytrain.data.dataset import MicroBatchLoader, TokenDataset, eval_batches, hold_out


    def rows(first, count):
        ids = torch.arange(first * 4, (first + count) * 4).view(count, 4)
        return TokenDataset(ids, ids.clone(), rejected_ids=ids + 100, advantages=ids[:, 0].float() / 16)


    def agree(x):
        assert torch.equal(x.rejected_ids, x.input_ids + 100), x
        assert torch.equal(x.advantages, x.input_ids[:, 0].float() / 16) and x.advantages.dtype == torch.float32, x


    whole = rows(0, 8)
    train, held_out = hold_out(whole, 0.25, seed=0)
    agree(train), agree(held_out)

    for mb in MicroBatchLoader(train, 2, 3, shuffle=True, seed=1).minibatch(0):
        agree(mb), agree(mb.to("cpu")), agree(mb.rows(slice(1, 2), replica=1))
        if torch.cuda.is_available():
            agree(mb.pin_memory())

    (filled,), = eval_batches(held_out, 3, 1)  # 2 rows and one filling: no advantage, a real row's inputs
    agree(filled.rows(slice(0, 2)))
    assert filled.advantages[2] == 0.0 and torch.equal(filled.rejected_ids[2], filled.rejected_ids[0])

    entry = Path(sys.argv[1])
    cache._write_entry(entry, {"format": cache.FORMAT}, lambda tokenizer_dir: (train, held_out))
    read_train, read_held_out = cache._read_entry(entry)
    agree(read_train), agree(read_held_out)
    assert torch.equal(read_train.advantages, train.advantages)


    class Numbered(stream.StreamRows):
        """Record k is row k of `rows`."""

        def tokenizer(self, cfg):
            return None

        def encode(self, cfg, records, tokenizer):
            return rows(records[0][1]["k"], len(records))


    stream.stream_rows = lambda *args, **kwargs: iter([(f"row {k}", {"k": k}) for k in range(8)])
    cfg = SimpleNamespace(data=SimpleNamespace(path="eight records", split="train", name=None))
    streamed = stream.StreamLoader(stream.StreamedSet(cfg, rows=Numbered()), 2, 2, shuffle=False, seed=0)
    for mb in streamed.minibatch(1):
        agree(mb)
        assert mb.input_ids[0, 0] >= 16 and mb.draw.step == 1  # records 4..7
    print("every holder carried the added fields")
''')


@pytest.mark.slow
def test_a_field_added_to_the_definition_flows_through_every_holder_of_rows(tmp_path):
    done = subprocess.run([sys.executable, "-c", FLOW, str(tmp_path / "entry")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "every holder carried the added fields" in done.stdout


def test_the_dataset_the_micro_batch_and_the_cache_hold_the_defined_fields_in_order():
    for holder in (TokenDataset, MicroBatch):
        assert tuple(f.name for f in dataclasses.fields(holder))[: len(row.FIELDS)] == row.names()
    ids = torch.zeros(2, 3, dtype=torch.long)
    stored = cache._stored(TokenDataset(ids, ids))
    assert tuple(stored) == (*row.names(), "facts", "rows_per_item", "records") and stored["input_ids"].dtype == torch.int32
    assert MicroBatch(ids, ids, ids).attention_mask is ids  # positional construction keeps its meaning


def test_an_entry_written_before_an_optional_field_existed_reads_it_as_none():
    ids = torch.arange(6, dtype=torch.int32).view(2, 3)
    old = {"input_ids": ids, "labels": ids, "facts": {"records": 2}}  # no attention_mask, no position_ids
    dataset = cache._dataset(old)
    assert dataset.attention_mask is None and dataset.position_ids is None and dataset.input_ids.dtype == torch.long
    with pytest.raises(KeyError):
        cache._dataset({"input_ids": ids, "facts": {}})  # a required field missing: an unreadable entry


def test_a_field_filled_in_the_wrong_shape_is_said_where_the_set_is_made():
    ids = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"attention_mask is \(4, 7\) in a set of 4 rows of 8 tokens"):
        TokenDataset(ids, ids, attention_mask=ids[:, :7])
    TokenDataset(ids, torch.zeros(4, dtype=torch.long))  # classification labels: one a row


@pytest.mark.parametrize("fields, says", [
    ((row.FIELDS[0], row.Field("rejected_ids", "", row.Per.TOKEN, optional=True), row.FIELDS[1]),
     "required fields come before"),
    ((*row.FIELDS, row.Field("advantages", "", row.Per.ROW, optional=True, target=True)), "needs a pad value"),
    ((*row.FIELDS, row.FIELDS[1]), "distinct names"),
])
def test_a_definition_the_holders_cannot_be_built_from_is_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        row.check_fields(fields)
