"""The claims' metadata, one data file per source text: ``seed000.toml`` … ``seed004.toml``, one
``[[claim]]`` table per claim in the order of the text (id, section, quote, paraphrase, api,
declared verdict, assumptions, ``slow``, ``subjects``). The checks that judge them are code, one
module per subject, in `attnlab.textbook.checks`; `attnlab.textbook.all_claims` joins both by
claim id."""
