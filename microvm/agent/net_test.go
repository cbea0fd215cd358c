package main

import (
	"bufio"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"
)

// The egress pipe copies both ways, carries the guest's half-close to moat
// and ends with moat's end.
func TestEgressPipe(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	got := make(chan string, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			got <- err.Error()
			return
		}
		b, _ := io.ReadAll(c) // until the guest's half-close
		got <- string(b)
		io.WriteString(c, "response\n")
		c.Close()
	}()
	var out strings.Builder
	if rc := egressPipe(sock, strings.NewReader("GET / HTTP/1.1\r\n\r\n"), &out); rc != 0 {
		t.Fatalf("egressPipe returned %d", rc)
	}
	if g := <-got; g != "GET / HTTP/1.1\r\n\r\n" {
		t.Errorf("moat got %q", g)
	}
	if line, _ := bufio.NewReader(strings.NewReader(out.String())).ReadString('\n'); line != "response\n" {
		t.Errorf("the guest got %q", out.String())
	}
	if rc := egressPipe(filepath.Join(t.TempDir(), "none"), strings.NewReader(""), io.Discard); rc == 0 {
		t.Errorf("egressPipe to no socket returned 0")
	}
}
