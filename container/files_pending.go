package container

import (
	"context"
	"fmt"
	"io"

	"github.com/moatsandbox/moat"
)

// newSessionFiles is replaced by internal/sessionfiles once it lands.
func newSessionFiles(exec func(ctx context.Context, argv []string, stdin io.Reader, stdout io.Writer) error) moat.Files {
	return pendingFiles{}
}

type pendingFiles struct{}

var errPending = fmt.Errorf("container: session files: not yet: %w", moat.ErrUnavailable)

func (pendingFiles) WriteFile(context.Context, string, io.Reader) error      { return errPending }
func (pendingFiles) ReadFile(context.Context, string) (io.ReadCloser, error) { return nil, errPending }
func (pendingFiles) ListFiles(context.Context) ([]moat.FileInfo, error)      { return nil, errPending }
func (pendingFiles) Stat(context.Context, string) (moat.FileInfo, error) {
	return moat.FileInfo{}, errPending
}
func (pendingFiles) Mkdir(context.Context, string) error          { return errPending }
func (pendingFiles) Rename(context.Context, string, string) error { return errPending }
func (pendingFiles) RemoveFile(context.Context, string) error     { return errPending }
