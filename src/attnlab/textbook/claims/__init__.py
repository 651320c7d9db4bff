"""One module per source text (``seed000`` … ``seed004``); each registers its claims with
`attnlab.textbook.core.claim` (and its exercises with `attnlab.textbook.exercises.exercise`)
when imported. `attnlab.textbook.all_claims` imports every module of this package."""
