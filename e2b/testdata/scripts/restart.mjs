// Drives sandboxes across a restart of moat serve through the unchanged
// SDKs. MOAT_PHASE=before makes a code interpreter sandbox that keeps a
// file, and one that times out while the server is down, and prints their
// ids; MOAT_PHASE=after (MOAT_ID, MOAT_SHORT: those ids) lists them,
// connects to the first, reads its file back with files, commands and
// runCode, and finds the second gone. The Go test (e2b's
// TestSandboxesSurviveRestart) checks what it prints: one JSON line per
// step.
import { Sandbox } from '@e2b/code-interpreter'

const out = (step, v) => console.log(JSON.stringify({ step, ...v }))

if (process.env.MOAT_PHASE === 'before') {
  const sbx = await Sandbox.create({ metadata: { suite: 'restart' }, envs: { KEPT: 'kept env' } })
  await sbx.files.write('/home/user/data.txt', 'kept across the restart')
  const x = await sbx.runCode('x = 41\nx + 1')
  const short = await Sandbox.create('base', { timeoutMs: 3000, metadata: { suite: 'restart' } })
  out('before', { id: sbx.sandboxId, short: short.sandboxId, text: x.text })
} else {
  const listed = await Sandbox.list({ query: { metadata: { suite: 'restart' } } }).nextItems()
  out('listed', { ids: listed.map((s) => s.sandboxId + ':' + s.state) })
  const sbx = await Sandbox.connect(process.env.MOAT_ID)
  out('read', { text: await sbx.files.read('/home/user/data.txt') })
  const cmd = await sbx.commands.run('cat data.txt; echo; echo "$KEPT"')
  out('command', { stdout: cmd.stdout })
  const cell = await sbx.runCode('open("data.txt").read()')
  out('cell', { text: cell.text, error: cell.error?.name ?? null })
  let short
  try {
    await Sandbox.connect(process.env.MOAT_SHORT)
    short = 'connected'
  } catch (e) {
    short = e.name
  }
  out('short', { error: short })
  out('kill', { killed: await sbx.kill() })
}
