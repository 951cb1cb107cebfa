"""Reads a `braid pack` output folder with pyarrow alone and checks it against dataset.json.

    /work/venv/bin/python tools/check_shards_pyarrow.py DIR [DIR ...]

Checks: every shard listed in dataset.json opens with pyarrow.parquet as written (zstd), its
row and pack counts and SHA-256 match, pack numbers run 0.. without gaps, every row's `ids` and
`loss_mask` have `llm_len` entries, the placeholder spans lie inside the row, and the totals
(`packed_samples`, `tokens`, `images`, `audio_clips`, `samples = packed_samples + rejected`,
`rejected` = lines of rejects.jsonl) add up. Exits 1 on the first mismatch.
"""

import hashlib
import json
import os
import sys

import pyarrow.parquet as pq


def check(folder):
    info = json.load(open(os.path.join(folder, "dataset.json")))
    rows = tokens = images = clips = 0
    next_pack = 0
    for s in info["shards"]:
        path = os.path.join(folder, s["file"])
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
        assert digest == s["sha256"], f"{path}: sha256 {digest} != {s['sha256']}"
        pf = pq.ParquetFile(path)
        codecs = {pf.metadata.row_group(0).column(i).compression for i in range(pf.metadata.num_columns)}
        assert codecs == {"ZSTD"}, f"{path}: codecs {codecs}"
        t = pq.read_table(path)
        assert t.num_rows == s["rows"], f"{path}: {t.num_rows} rows != {s['rows']}"
        assert pf.metadata.num_row_groups == s["row_groups"]
        packs = t.column("pack").to_pylist()
        distinct = sorted(set(packs))
        assert distinct == list(range(next_pack, next_pack + len(distinct))), f"{path}: pack numbers"
        assert len(distinct) == s["packs"]
        next_pack += len(distinct)
        for r in t.to_pylist():
            n = r["llm_len"]
            assert len(r["ids"]) == n and len(r["loss_mask"]) == n, r["id"]
            for m in r["images"] + r["audio"]:
                assert 0 <= m["llm_offset"] and m["llm_offset"] + m["llm_tokens"] <= n, r["id"]
            rows += 1
            tokens += n
            images += len(r["images"])
            clips += len(r["audio"])
    with open(os.path.join(folder, "rejects.jsonl")) as f:
        rejected = sum(1 for _ in f)
    got = dict(packed_samples=rows, tokens=tokens, images=images, audio_clips=clips, packs=next_pack, rejected=rejected)
    for k, v in got.items():
        assert info[k] == v, f"{folder}: dataset.json {k} = {info[k]}, shards say {v}"
    assert info["samples"] == info["packed_samples"] + info["rejected"]
    print(f"ok {folder}: {len(info['shards'])} shards, {rows} samples, {next_pack} packs, {tokens} tokens, "
          f"{images} images, {clips} clips, {rejected} rejected, fill {info['fill']:.4f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for d in sys.argv[1:]:
        check(d)
