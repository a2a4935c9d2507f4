"""sparsetune inside SGLang: `plugin` (the entry point SGLang calls: registers the backend; cheap to
import) and `backend` (`SparsetuneBackend`; imports SGLang, torch and the flow compiler). The
names they share (the backend's, the bundle variable, the supported versions) are in
`export.bundle`, which writes what launches them."""
