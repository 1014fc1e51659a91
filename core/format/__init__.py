"""bestiary.core.format: what the convert side and the runtime share.

The checkpoint schema (`config`), the engine's build limits (`build_config`), checkpoint and
engine directories on disk (`checkpoint`), user-facing errors (`errors`), the per-user cache
location (`cache`) and progress bars (`progress`).

Imports: nothing of bestiary outside `bestiary.core.format`; only `checkpoint` imports torch, so the
CLI can read configs and build its flags without it.
"""
