package owner

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

func TestSelfIsAliveAndStable(t *testing.T) {
	dir := t.TempDir()
	id, err := Self(dir)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := Self(dir)
	if again != id {
		t.Errorf("Self changed: %s then %s", id, again)
	}
	if got, ok := Of(id + "-run"); !ok || got != id {
		t.Errorf("Of(%q) = %q, %v", id+"-run", got, ok)
	}
	if !Alive(dir, id) {
		t.Error("this process is not alive to itself")
	}
}

// TestDeadOwner: a child process takes an id and exits; its id is dead
// (and its file is gone afterwards), while a live child's id is alive.
func TestDeadOwner(t *testing.T) {
	if os.Getenv("OWNER_CHILD") != "" {
		id, err := Self(os.Getenv("OWNER_CHILD"))
		if err != nil {
			os.Exit(2)
		}
		os.Stdout.WriteString(id)
		if os.Getenv("OWNER_WAIT") != "" {
			os.Stdin.Read(make([]byte, 1)) // live until the parent closes stdin
		}
		os.Exit(0)
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=TestDeadOwner")
	cmd.Env = append(os.Environ(), "OWNER_CHILD="+dir)
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	dead := string(out)
	if Alive(dir, dead) {
		t.Errorf("the exited child's id %s is alive", dead)
	}
	if _, err := os.Stat(filepath.Join(dir, dead)); !os.IsNotExist(err) {
		t.Errorf("the dead owner's file remains: %v", err)
	}
	if Alive(dir, "0123456789abcdef") {
		t.Error("an id with no file is alive")
	}

	live := exec.Command(os.Args[0], "-test.run=TestDeadOwner")
	live.Env = append(os.Environ(), "OWNER_CHILD="+dir, "OWNER_WAIT=1")
	stdin, _ := live.StdinPipe()
	stdout, _ := live.StdoutPipe()
	if err := live.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	if _, err := stdout.Read(buf); err != nil {
		t.Fatal(err)
	}
	if !Alive(dir, string(buf)) {
		t.Errorf("the running child's id %s is not alive", buf)
	}
	stdin.Close()
	live.Wait()
}
