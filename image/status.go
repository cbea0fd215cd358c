package image

import "time"

// Status says whether the root filesystem for a Config is built, when and
// how big. It is what `moat image status` and `moat doctor` print of it.
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
	// Tag is the reference the container level imports it as
	// (container.ImportImage); whether the engine holds it is
	// container.InspectImage's to say.
	Tag string `json:"tag"`
}

// GetStatus reports on the root filesystem for cfg from the state
// directory alone; it never builds anything and never needs root.
func GetStatus(cfg Config) Status {
	cfg = cfg.WithDefaults()
	s := Status{Key: cfg.Key(), Path: Path(cfg), Tag: cfg.Tag()}
	if r, err := readRecord(cfg.Dir()); err == nil && exists(s.Path) {
		s.Exists, s.BuiltAt, s.Size, s.Python, s.Record = true, r.BuiltAt, r.Size, r.PythonVersion, r
		s.Age = time.Since(r.BuiltAt).Round(time.Second).String()
	}
	return s
}
