package microvm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"syscall"

	"github.com/moatsandbox/moat/image"
)

// This file makes what a VM boots from, each cached in the state directory
// under a key of everything that decides its content:
//
//	STATE/microvm/kernels/REL/        a Debian linux-image package, extracted
//	                                  (boot/vmlinuz-REL, lib/modules/REL)
//	STATE/microvm/agent/KEY/agent     the guest agent, built static
//	STATE/microvm/initrd/KEY.cpio     the initramfs: the agent as /init and
//	                                  the modules the guest needs
//	STATE/microvm/disks/KEY.ext4      the shared root filesystem as a
//	                                  read-only ext4 image
//	STATE/microvm/templates/KEY/      a booted VM, saved (see template.go)

// guestModules are the drivers the guest needs, dependencies first, with
// the config option that builds each in. The cloud kernel has virtio-mmio,
// virtio-blk, virtio-console and overlayfs as modules, which the initramfs
// carries and the agent loads; moat's own minimal kernel (kernel/) has them
// built in.
var guestModules = []struct{ path, option string }{
	{"kernel/drivers/virtio/virtio_ring.ko", "CONFIG_VIRTIO"},
	{"kernel/drivers/virtio/virtio.ko", "CONFIG_VIRTIO"},
	{"kernel/drivers/virtio/virtio_mmio.ko", "CONFIG_VIRTIO_MMIO"},
	{"kernel/drivers/block/virtio_blk.ko", "CONFIG_VIRTIO_BLK"},
	{"kernel/drivers/char/virtio_console.ko", "CONFIG_VIRTIO_CONSOLE"},
	{"kernel/fs/overlayfs/overlay.ko", "CONFIG_OVERLAY_FS"},
}

// netModules are the drivers of a VM with a network (Config.Egress),
// dependencies first: virtio-net. They are in the initramfs of such VMs
// only.
var netModules = []struct{ path, option string }{
	{"kernel/net/core/failover.ko", "CONFIG_VIRTIO_NET"},
	{"kernel/drivers/net/net_failover.ko", "CONFIG_VIRTIO_NET"},
	{"kernel/drivers/net/virtio_net.ko", "CONFIG_VIRTIO_NET"},
}

// kernel is a guest kernel and the modules it must load.
type kernel struct {
	Release string   // e.g. 6.1.0-57-cloud-amd64
	Image   string   // DIR/boot/vmlinuz-REL
	Modules []string // under DIR/lib/modules/REL, in load order
	NoACPI  bool     // built without ACPI (see VMSpec.NoACPI)
	// NetModules are the modules a VM with a network loads too; NetErr,
	// when not nil, says why the kernel cannot have one.
	NetModules []string
	NetErr     error
	// Ignored are the unfinished kernels findKernel passed over (NAME.tmp).
	Ignored []string
}

// findKernel returns the kernel in dir (an extracted linux-image package,
// or moat's own build: DIR/boot/vmlinuz-REL, DIR/boot/config-REL and, for
// what is not built in, DIR/lib/modules/REL), or when dir is empty the
// best under STATE/microvm/kernels: moat's minimal kernel (moat-*, made by
// kernel/build.sh), which boots faster, else the newest Debian one.
//
// Under STATE/microvm/kernels it ignores what is not finished: the set-up
// (scripts/setup-microvm.sh) builds or extracts each kernel into NAME.tmp
// and renames it into place once complete, so a NAME.tmp (or a hidden
// .NAME) is a kernel being made, or one whose making died. They are listed
// in the kernel's Ignored, and in the error when nothing else is usable.
func findKernel(stateDir, dir string) (*kernel, error) {
	dirs := []string{dir}
	var ignored []string
	if dir == "" {
		found, _ := filepath.Glob(filepath.Join(stateDir, "microvm", "kernels", "*"))
		dirs = nil
		for _, d := range found {
			if name := filepath.Base(d); strings.HasSuffix(name, ".tmp") || strings.HasPrefix(name, ".") {
				ignored = append(ignored, name)
				continue
			}
			dirs = append(dirs, d)
		}
		sort.Slice(dirs, func(i, j int) bool {
			mi, mj := strings.HasPrefix(filepath.Base(dirs[i]), "moat-"), strings.HasPrefix(filepath.Base(dirs[j]), "moat-")
			if mi != mj {
				return mi
			}
			return dirs[i] > dirs[j]
		})
	}
	var problems []string
	for _, d := range dirs {
		imgs, _ := filepath.Glob(filepath.Join(d, "boot", "vmlinuz-*"))
		for _, img := range imgs {
			rel := strings.TrimPrefix(filepath.Base(img), "vmlinuz-")
			k, err := kernelAt(d, rel, img)
			if err == nil {
				k.Ignored = ignored
				return k, nil
			}
			problems = append(problems, err.Error())
		}
	}
	where := dir
	if where == "" {
		where = filepath.Join(stateDir, "microvm", "kernels")
	}
	if len(ignored) > 0 {
		problems = append(problems, "ignored, unfinished: "+strings.Join(ignored, ", ")+" (is the set-up still making it? it renames a kernel into place once complete)")
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("microvm: no usable guest kernel in %s: %s", where, strings.Join(problems, "; "))
	}
	return nil, fmt.Errorf("microvm: no guest kernel in %s", where)
}

func kernelAt(dir, rel, img string) (*kernel, error) {
	config, _ := os.ReadFile(filepath.Join(dir, "boot", "config-"+rel))
	builtin := func(option string) bool {
		return bytes.Contains(config, []byte("\n"+option+"=y\n"))
	}
	k := &kernel{Release: rel, Image: img, NoACPI: len(config) > 0 && !builtin("CONFIG_ACPI")}
	mods := filepath.Join(dir, "lib", "modules", rel)
	for _, m := range guestModules {
		p := filepath.Join(mods, m.path)
		if _, err := os.Stat(p); err == nil {
			k.Modules = append(k.Modules, p)
		} else if !builtin(m.option) {
			return nil, fmt.Errorf("%s: neither %s nor %s=y in its config", img, p, m.option)
		}
	}
	for _, m := range netModules {
		p := filepath.Join(mods, m.path)
		if _, err := os.Stat(p); err == nil {
			k.NetModules = append(k.NetModules, p)
		} else if !builtin(m.option) {
			k.NetModules = nil
			k.NetErr = fmt.Errorf("%s has no virtio-net: neither %s nor %s=y in its config", img, p, m.option)
			break
		}
	}
	return k, nil
}

// fileKey hashes the paths, sizes and modification times of files: enough
// to notice that an extracted kernel or a binary changed.
func fileKey(h io.Writer, paths ...string) error {
	for _, p := range paths {
		st, err := os.Stat(p)
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%s %d %d\n", p, st.Size(), st.ModTime().UnixNano())
	}
	return nil
}

// agentSource returns the directory of the agent's source and of the
// protocol it speaks, as they were when this package was built, if they
// are still there.
func agentSource() (agent, wire string, ok bool) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", "", false
	}
	dir := filepath.Dir(file)
	agent, wire = filepath.Join(dir, "agent"), filepath.Join(dir, "internal", "wire")
	if _, err := os.Stat(filepath.Join(agent, "main.go")); err != nil {
		return "", "", false
	}
	return agent, wire, true
}

// installedAgent is where scripts/setup-microvm.sh puts a built agent, for
// moat binaries that run far from their source.
func installedAgent(stateDir string) string {
	return filepath.Join(stateDir, "microvm", "bin", "moat-guest-agent")
}

// ensureAgent returns the path of a static build of the guest agent: the
// configured one, a cached build of the source this package was built
// from, or the installed one.
func ensureAgent(ctx context.Context, stateDir, configured string) (string, error) {
	if configured != "" {
		if _, err := os.Stat(configured); err != nil {
			return "", fmt.Errorf("microvm: agent: %w", err)
		}
		return configured, nil
	}
	src, wireSrc, ok := agentSource()
	if !ok {
		p := installedAgent(stateDir)
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("microvm: the guest agent's source is not here and no agent is installed at %s (run scripts/setup-microvm.sh): %w", p, err)
		}
		return p, nil
	}
	h := sha256.New()
	fmt.Fprintf(h, "agent go=%s arch=%s\n", runtime.Version(), runtime.GOARCH)
	for _, d := range []string{src, wireSrc} {
		files, _ := filepath.Glob(filepath.Join(d, "*.go"))
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			b, err := os.ReadFile(f)
			if err != nil {
				return "", fmt.Errorf("microvm: agent source: %w", err)
			}
			fmt.Fprintf(h, "%s %d\n", filepath.Base(f), len(b))
			h.Write(b)
		}
	}
	key := hex.EncodeToString(h.Sum(nil))[:16]
	out := filepath.Join(stateDir, "microvm", "agent", key, "agent")
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	return out, lockedBuild(out, func(tmp string) error {
		goBin, err := exec.LookPath("go")
		if err != nil {
			goBin = "/usr/local/go/bin/go"
			if _, e := os.Stat(goBin); e != nil {
				return fmt.Errorf("no go toolchain to build the guest agent (install Go, or run scripts/setup-microvm.sh where one is): %w", err)
			}
		}
		cmd := exec.CommandContext(ctx, goBin, "build", "-trimpath", "-ldflags=-s -w", "-o", tmp, ".")
		cmd.Dir = src
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build the guest agent: %w: %s", err, bytes.TrimSpace(out))
		}
		return nil
	})
}

// lockedBuild makes the file out once: under a lock, unless it exists, it
// calls build with a temporary path in the same directory and renames the
// result into place, readable by everyone.
func lockedBuild(out string, build func(tmp string) error) error {
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return fmt.Errorf("microvm: %w", err)
	}
	unlock, err := lockFile(out + ".lock")
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := os.Stat(out); err == nil {
		return nil
	}
	tmp := fmt.Sprintf("%s.tmp-%d", out, os.Getpid())
	os.RemoveAll(tmp)
	if err := build(tmp); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("microvm: make %s: %w", filepath.Base(out), err)
	}
	os.Chmod(tmp, 0o644|modeExec(tmp))
	if err := os.Rename(tmp, out); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("microvm: %w", err)
	}
	return nil
}

func modeExec(p string) os.FileMode {
	if st, err := os.Stat(p); err == nil && st.Mode()&0o100 != 0 {
		return 0o755
	}
	return 0
}

// lockFile takes an exclusive flock on path, waiting for it.
func lockFile(path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("microvm: lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("microvm: lock %s: %w", path, err)
	}
	return func() { f.Close() }, nil
}

// ensureInitrd returns the initramfs holding agent as /init and the guest
// modules of k, with its network modules too when withNet.
func ensureInitrd(stateDir, agent string, k *kernel, withNet bool) (string, error) {
	h := sha256.New()
	fmt.Fprintf(h, "initrd v1 %s\n", k.Release)
	mods := k.Modules
	if withNet {
		mods = append(slices.Clip(mods), k.NetModules...)
	}
	if err := fileKey(h, append([]string{agent, k.Image}, mods...)...); err != nil {
		return "", fmt.Errorf("microvm: initrd: %w", err)
	}
	out := filepath.Join(stateDir, "microvm", "initrd", hex.EncodeToString(h.Sum(nil))[:16]+".cpio")
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	return out, lockedBuild(out, func(tmp string) error {
		f, err := os.Create(tmp)
		if err != nil {
			return err
		}
		defer f.Close()
		w := newCpio(f)
		w.dir("dev")
		w.node("dev/console", syscall.S_IFCHR|0o600, 5, 1)
		w.dir("modules")
		var order []string
		for _, m := range mods {
			b, err := os.ReadFile(m)
			if err != nil {
				return err
			}
			w.file("modules/"+filepath.Base(m), 0o644, b)
			order = append(order, filepath.Base(m))
		}
		w.file("modules/order", 0o644, []byte(strings.Join(order, "\n")))
		b, err := os.ReadFile(agent)
		if err != nil {
			return err
		}
		w.file("init", 0o755, b)
		if err := w.close(); err != nil {
			return err
		}
		return f.Close()
	})
}

// ensureDisk returns the shared root filesystem of img as an ext4 image,
// made with mkfs.ext4 -d: uncompressed, so that a guest without hardware
// acceleration spends no emulated CPU on decompression.
func ensureDisk(ctx context.Context, stateDir string, img image.Config) (string, error) {
	root := image.Path(img)
	if _, err := os.Stat(root); err != nil {
		return "", fmt.Errorf("%w: %s", image.ErrNotBuilt, root)
	}
	out := filepath.Join(stateDir, "microvm", "disks", img.Key()[:16]+".ext4")
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		for _, p := range []string{"/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"} {
			if _, e := os.Stat(p); e == nil {
				mkfs, err = p, nil
			}
		}
		if err != nil {
			return "", fmt.Errorf("microvm: mkfs.ext4 not found (apt-get install e2fsprogs): %w", err)
		}
	}
	size, err := treeSize(root)
	if err != nil {
		return "", fmt.Errorf("microvm: disk: %w", err)
	}
	mib := size*5/4/(1<<20) + 64
	return out, lockedBuild(out, func(tmp string) error {
		cmd := exec.CommandContext(ctx, mkfs, "-q", "-F", "-t", "ext4", "-O", "^has_journal", "-L", "moat-root",
			"-E", "root_owner=0:0", "-d", root, tmp, fmt.Sprintf("%dM", mib))
		cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("mkfs.ext4: %w: %s", err, bytes.TrimSpace(out))
		}
		return nil
	})
}

func treeSize(root string) (int64, error) {
	var n int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if info, err := d.Info(); err == nil {
			n += (info.Size() + 4095) &^ 4095
		}
		n += 256 // the inode
		return nil
	})
	return n, err
}

// cpio writes a "newc" cpio archive, the format of an initramfs.
type cpio struct {
	w   io.Writer
	ino int
	err error
}

func newCpio(w io.Writer) *cpio { return &cpio{w: w, ino: 1} }

func (c *cpio) entry(name string, mode uint32, rmajor, rminor uint32, data []byte) {
	if c.err != nil {
		return
	}
	c.ino++
	nlink := 1
	if mode&syscall.S_IFMT == syscall.S_IFDIR {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		c.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rmajor, rminor, len(name)+1, 0)
	var b bytes.Buffer
	b.WriteString(hdr)
	b.WriteString(name)
	b.WriteByte(0)
	pad(&b, b.Len())
	b.Write(data)
	pad(&b, len(data))
	_, c.err = c.w.Write(b.Bytes())
}

func pad(b *bytes.Buffer, n int) {
	for n%4 != 0 {
		b.WriteByte(0)
		n++
	}
}

func (c *cpio) dir(name string) { c.entry(name, syscall.S_IFDIR|0o755, 0, 0, nil) }
func (c *cpio) file(name string, perm uint32, data []byte) {
	c.entry(name, syscall.S_IFREG|perm, 0, 0, data)
}
func (c *cpio) node(name string, mode, major, minor uint32) { c.entry(name, mode, major, minor, nil) }
func (c *cpio) close() error {
	c.entry("TRAILER!!!", 0, 0, 0, nil)
	return c.err
}
