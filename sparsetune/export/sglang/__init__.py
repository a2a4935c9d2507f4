"""sparsetune inside SGLang: `plugin` (the entry point SGLang calls: registers the backend; cheap to
import) and `backend` (`SparsetuneBackend`; imports SGLang, torch and the flow compiler)."""

NAME = "sparsetune"  # the attention backend's name: --attention-backend sparsetune
BUNDLE_ENV = "SPARSETUNE_BUNDLE"  # the bundle the backend serves, by path (SGLang's processes inherit it)
