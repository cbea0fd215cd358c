// Package envd holds the Go code generated from process.proto and
// filesystem.proto: the messages and Connect handlers of the two services
// of E2B's in-sandbox daemon that package e2b serves.
//
// To regenerate (buf and both plugins come from the Go module proxy):
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.8
//	go install connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.19.1
//	go generate ./e2b/internal/envd
package envd

//go:generate go run github.com/bufbuild/buf/cmd/buf@v1.57.2 generate
