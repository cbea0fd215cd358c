package subprocess

import "github.com/moatsandbox/moat/internal/engine"

// loaderNoexec is what glibc's loader says (through dlopen, ctypes or an
// extension module's import) when mmap refuses to map a shared object's
// code: the file is on a noexec mount. At this level every directory the
// run may write (its working directory) is noexec, so the message means a
// shared object the run wrote or uploaded, never one of the host's.
const loaderNoexec = "failed to map segment from shared object"

// noexecNote is the note a run gets when its stderr shows loaderNoexec.
const noexecNote = "a shared object could not be loaded (" + `"` + loaderNoexec + `"` + "): the run's working directory is mounted noexec at the subprocess level, " +
	"so native code the run writes or uploads (a .so, a binary) cannot be mapped executable or run; native code must come from the host's packages " +
	"(apt install python3-numpy on the host), or run at the gvisor or microvm level, whose own kernel confines it"

// nativeHints are the engine's hints (engine.Config.Hints) of this level.
var nativeHints = []engine.Hint{{In: loaderNoexec, Note: noexecNote}}
