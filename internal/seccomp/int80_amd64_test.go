//go:build linux

package seccomp

import (
	"fmt"
	"os"
	"syscall"
	"testing"
	"unsafe"
)

// int80Code is i386 getpid made from 64-bit code:
//
//	mov eax, 20   ; __NR_getpid in the i386 table
//	int 0x80
//	ret
//
// The kernel runs the filter with seccomp_data.arch = AUDIT_ARCH_I386.
var int80Code = []byte{0xb8, 0x14, 0x00, 0x00, 0x00, 0xcd, 0x80, 0xc3}

// int80Main calls int80Code and prints the pid it returned. Under the
// filter the process must die of SIGSYS before it prints anything.
func int80Main() int {
	mem, err := syscall.Mmap(-1, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	copy(mem, int80Code)
	if err := syscall.Mprotect(mem, syscall.PROT_READ|syscall.PROT_EXEC); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	// A Go func value points to a word holding the code address. The code
	// only clobbers AX, which the Go ABI lets a callee clobber.
	entry := uintptr(unsafe.Pointer(&mem[0]))
	fv := &entry
	call := *(*func())(unsafe.Pointer(&fv))
	call()
	fmt.Println("returned")
	return 0
}

// TestForeignArchKills makes an i386 system call under the filter and
// checks that the kernel killed the process with SIGSYS; without the
// filter the same call returns.
func TestForeignArchKills(t *testing.T) {
	t.Parallel()
	out, state := runChild(t, "int80-plain")
	if !state.Success() || string(out) != "returned\n" {
		t.Fatalf("without the filter the i386 call did not return: %v, output %q (no IA32 emulation?)", state, out)
	}
	out, state = runChild(t, "int80")
	ws := state.Sys().(syscall.WaitStatus)
	if !ws.Signaled() || ws.Signal() != syscall.SIGSYS || len(out) != 0 {
		t.Errorf("under the filter: %v, output %q; want killed by SIGSYS before any output", state, out)
	}
}
