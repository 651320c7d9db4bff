"""The checks of the source texts' claims, one module per subject of the library (``scale``,
``masks``, ``positions``, ``costs``, ``heads``, …): a claim's home is the first of its
``subjects`` (the data files ``attnlab/textbook/claims/seed00N.toml``) apart from the catch-all
``scale``, so the checks of the same fact sit side by side whichever text states it, and one
function registered with several ids serves every claim of the same fact. Each function is
registered by claim id with `attnlab.textbook.core.check` (the exercise solutions with
`attnlab.textbook.exercises.exercise`) when its module is imported; `attnlab.textbook.all_claims`
imports every module of this package. Helpers several subjects use are in ``_shared``."""
