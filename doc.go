// Package moat runs untrusted code, written by language-model agents, behind
// one interface and several interchangeable isolation levels.
//
// This package holds the domain only: the [Sandbox] interface, the operator's
// [Limits], the [Result] of a run and the errors. It imports no backend. Each
// isolation level lives in a package of its own (subprocess, and later
// container, gvisor and microvm) and returns a [Sandbox]; every level passes
// the same conformance suite in package sandboxtest.
//
// The limits, the hardening and the rest of a sandbox's configuration belong
// to the operator who builds the sandbox. The code being run, and the model
// that wrote it, never choose them: a [Sandbox] takes nothing from a run but
// the code.
//
// A failure of the user's code (a non-zero exit, a limit hit, a crash) is a
// [Result] with a [Reason]. An error from [Sandbox.Run] means the sandbox
// itself failed or refused to run; see [ErrUnavailable] and [ErrInvalid].
package moat
