package main

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// The guest's network, when the VM has one (a sandbox with egress): one
// virtio-net device on QEMU's user network, which with restrict=on carries
// nothing but connections to the one guestfwd address, moat's egress proxy.
// The agent gives the device the user network's guest address and no
// route beyond its /24: a connection to anything else fails at once in the
// guest, and would reach nothing past QEMU if it did not.
const (
	netDevice = "eth0"
	guestAddr = "10.0.2.15"
	guestMask = "255.255.255.0"
	// caDir is a read-only tmpfs of its own in the run's root, holding the
	// egress proxy's CA bundle (caFile); the run's environment names it.
	caDir  = "/etc/moat"
	caFile = caDir + "/ca.pem"
)

// setupNet configures netDevice when the VM has it, and says what it did
// ("" when there is no device: a VM without network, as before).
func setupNet() (string, error) {
	if _, err := os.Stat("/sys/class/net/" + netDevice); errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("net: socket: %w", err)
	}
	defer unix.Close(fd)
	set := func(req uint, what string, fill func(*unix.Ifreq) error) error {
		ifr, err := unix.NewIfreq(netDevice)
		if err != nil {
			return err
		}
		if err := fill(ifr); err != nil {
			return err
		}
		if err := unix.IoctlIfreq(fd, req, ifr); err != nil {
			return fmt.Errorf("net: %s of %s: %w", what, netDevice, err)
		}
		return nil
	}
	if err := set(unix.SIOCSIFADDR, "address", func(ifr *unix.Ifreq) error {
		return ifr.SetInet4Addr(net.ParseIP(guestAddr).To4())
	}); err != nil {
		return "", err
	}
	if err := set(unix.SIOCSIFNETMASK, "netmask", func(ifr *unix.Ifreq) error {
		return ifr.SetInet4Addr(net.ParseIP(guestMask).To4())
	}); err != nil {
		return "", err
	}
	if err := set(unix.SIOCSIFFLAGS, "flags", func(ifr *unix.Ifreq) error {
		ifr.SetUint16(unix.IFF_UP | unix.IFF_RUNNING)
		return nil
	}); err != nil {
		return "", err
	}
	return netDevice + " " + guestAddr + "/24, no default route", nil
}

// writeCA places the egress proxy's CA bundle at caFile in the run's root,
// on a tmpfs of its own mounted read-only, owned by root and readable by
// the code. A later call (the next run of a session) replaces it.
func writeCA(bundle string) error {
	dir := newRoot + caDir
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("ca: %w", err)
	}
	unix.Unmount(dir, unix.MNT_DETACH)
	size := (len(bundle)+4095)&^4095 + 4096
	if err := unix.Mount("tmpfs", dir, "tmpfs", nosuid|unix.MS_NOEXEC,
		fmt.Sprintf("size=%d,nr_inodes=4,mode=0755", size)); err != nil {
		return fmt.Errorf("ca: mount: %w", err)
	}
	p := filepath.Join(dir, filepath.Base(caFile))
	if err := os.WriteFile(p, []byte(bundle), 0o444); err != nil {
		return fmt.Errorf("ca: %w", err)
	}
	if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_RDONLY|nosuid|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("ca: remount read-only: %w", err)
	}
	return nil
}

// pipeArg is the first argument that makes the agent's binary, run on the
// host, the egress pipe instead of the guest's init.
const pipeArg = "egress-pipe"

// egressPipe is the agent's binary run on the host by QEMU's user network
// (guestfwd=...-cmd:AGENT egress-pipe SOCKET), once per connection of the
// guest to the egress proxy's address, with the connection as its standard
// input, output and error: it connects to moat's unix socket for the VM and
// copies both ways. The guest's end half-closes moat's side, so that a
// response still comes back; moat's end ends the pipe, and so the guest's
// connection. It runs as the VM's QEMU uid under QEMU's seccomp filter,
// with no environment, and says nothing: its standard error is the guest's
// connection too.
func egressPipe(socket string, in io.Reader, out io.Writer) int {
	c, err := net.Dial("unix", socket)
	if err != nil {
		return 1
	}
	uc := c.(*net.UnixConn)
	go func() {
		io.Copy(uc, in)
		uc.CloseWrite()
	}()
	io.Copy(out, uc)
	return 0
}
