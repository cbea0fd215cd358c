package image

import (
	"context"
	"time"
)

// Status says whether the image for a Config is built and imported. It is
// what `moat image status` and `moat doctor` print.
type Status struct {
	Key    string `json:"key"`
	Path   string `json:"path"`
	Exists bool   `json:"exists"` // the root filesystem is built
	// BuiltAt, Age and Size describe the root filesystem when it exists.
	BuiltAt time.Time `json:"built_at,omitzero"`
	Age     string    `json:"age,omitempty"`
	Size    int64     `json:"size_bytes,omitempty"`
	Python  string    `json:"python,omitempty"`
	Record  *Record   `json:"record,omitempty"`

	Tag string `json:"tag"`
	// InDocker is true when the engine holds Tag with this key; DockerID is
	// its ID. Docker says why the engine could not be asked, if it could
	// not.
	InDocker bool   `json:"in_docker"`
	DockerID string `json:"docker_id,omitempty"`
	Docker   string `json:"docker,omitempty"`
}

// GetStatus reports on the image for cfg. It asks the Docker engine too when
// one answers; it never builds anything and never needs root.
func GetStatus(ctx context.Context, cfg Config) Status {
	cfg = cfg.WithDefaults()
	s := Status{Key: cfg.Key(), Path: Path(cfg), Tag: cfg.Tag()}
	if r, err := readRecord(cfg.Dir()); err == nil && exists(s.Path) {
		s.Exists, s.BuiltAt, s.Size, s.Python, s.Record = true, r.BuiltAt, r.Size, r.PythonVersion, r
		s.Age = time.Since(r.BuiltAt).Round(time.Second).String()
	}
	cli, err := dockerClient(ctx)
	if err != nil {
		s.Docker = err.Error()
		return s
	}
	defer cli.Close()
	id, ok, err := inspectImage(ctx, cli, s.Tag, s.Key)
	if err != nil {
		s.Docker = err.Error()
		return s
	}
	s.InDocker, s.DockerID = ok, id
	return s
}
