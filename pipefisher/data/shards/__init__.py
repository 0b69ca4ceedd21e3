"""Token shards: corpora tokenized once into memory-mapped arrays (`format`), prepared by
`pipefisher data prepare` and read by runs with `data.kind: shards`."""
