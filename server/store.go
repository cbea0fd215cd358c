package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/moatsandbox/moat"
)

// record is what the database keeps of a session: enough to know, after a
// crash, what existed and what to remove.
type record struct {
	ID    string     `json:"id"`
	Owner string     `json:"owner"` // the token's name
	Level moat.Level `json:"level"`
	// Network is the session's network profile, "" for none. It is fixed
	// at creation: every run of the session is under it.
	Network     string        `json:"network,omitempty"`
	Interpreter bool          `json:"interpreter"`
	CreatedAt   time.Time     `json:"created_at"`
	ExpiresAt   time.Time     `json:"expires_at"`
	IdleTimeout moat.Duration `json:"idle_timeout"`
	// Backend names the session inside its level (a directory, a
	// container), when the level's session says (an ID() string method).
	Backend string `json:"backend,omitempty"`
	// PID is the server process that made it.
	PID int `json:"pid"`

	// State is stateRunning, stateSuspended or stateBroken; empty (the
	// records of older servers) is running.
	State string `json:"state,omitempty"`
	// StateDir holds the suspended state (a suspended or broken session):
	// always <state_dir>/suspended/<id>, which recover checks rather than
	// trusting this field.
	StateDir string `json:"state_dir,omitempty"`
	// Suspend is what the last suspend kept; nil if the session was never
	// suspended.
	Suspend     *moat.SuspendInfo `json:"suspend,omitempty"`
	SuspendedAt time.Time         `json:"suspended_at,omitzero"`
	// Broken says why the suspended state was refused on resume.
	Broken string `json:"broken,omitempty"`
	// FromSnapshot is the snapshot the session was started from.
	FromSnapshot string `json:"from_snapshot,omitempty"`
	// Front is what a front end in the same process (package e2b) keeps
	// of the session, opaque to the server (see SessionSpec.Front).
	Front []byte `json:"front,omitempty"`
}

var sessionsBucket = []byte("sessions")

// ErrStateLocked means another server holds the state directory: one
// server at a time uses one. New returns it, wrapped, after waiting a
// second for the lock.
var ErrStateLocked = errors.New("server: the state dir is locked")

// store keeps session records in a bbolt database. bbolt's file lock makes
// sure that one server at a time uses a state directory.
type store struct {
	db *bolt.DB
}

func openStore(dir string) (*store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("server: state dir: %w", err)
	}
	path := filepath.Join(dir, "server.db")
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if errors.Is(err, bolterrors.ErrTimeout) {
		return nil, fmt.Errorf("server: %s: %w (another moat serve uses this state dir: stop it, or give this one a state dir of its own)", path, ErrStateLocked)
	}
	if err != nil {
		return nil, fmt.Errorf("server: open %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucketIfNotExists(sessionsBucket); err != nil {
			return err
		}
		_, err := tx.CreateBucketIfNotExists(snapshotsBucket)
		return err
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("server: %w", err)
	}
	return &store{db: db}, nil
}

func (st *store) put(r record) error {
	data, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("server: %w", err)
	}
	return st.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(sessionsBucket).Put([]byte(r.ID), data)
	})
}

func (st *store) delete(id string) error {
	return st.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(sessionsBucket).Delete([]byte(id))
	})
}

// all returns every record; unreadable ones come back with only their ID.
func (st *store) all() ([]record, error) {
	var out []record
	err := st.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(sessionsBucket).ForEach(func(k, v []byte) error {
			var r record
			if err := json.Unmarshal(v, &r); err != nil {
				r = record{}
			}
			r.ID = string(k)
			out = append(out, r)
			return nil
		})
	})
	return out, err
}

func (st *store) putIn(bucket []byte, key string, data []byte) error {
	return st.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).Put([]byte(key), data)
	})
}

func (st *store) deleteIn(bucket []byte, key string) error {
	return st.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).Delete([]byte(key))
	})
}

// allIn returns every value of bucket by key.
func (st *store) allIn(bucket []byte) (map[string][]byte, error) {
	out := map[string][]byte{}
	err := st.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucket).ForEach(func(k, v []byte) error {
			out[string(k)] = append([]byte{}, v...)
			return nil
		})
	})
	return out, err
}

func (st *store) close() error { return st.db.Close() }
